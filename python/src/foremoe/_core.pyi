"""Type stub of the `foremoe._core` extension (nanobind). Use the `foremoe` package API."""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

__version__: str

def _data_address(a: Any) -> int: ...
def count_loads(
    routed_experts: Any,
    microbatch_offsets: Optional[npt.NDArray[np.int64]],
    num_experts: int,
    layer_map: Optional[Sequence[int]],
    num_sources: int,
    source_offsets: Optional[npt.NDArray[np.int64]],
    mask: Optional[npt.NDArray[np.uint8]] = None,
) -> Tuple[npt.NDArray[np.int64], Optional[npt.NDArray[np.int64]]]: ...

class Topology:
    def __init__(
        self,
        nodes: int,
        gpus_per_node: int,
        slots: int,
        *,
        nvlink_gb_per_s: float = 450.0,
        network_gb_per_s: float = 50.0,
        pcie_gb_per_s: float = 55.0,
        nvlink_latency_us: float = 3.0,
        network_latency_us: float = 10.0,
        pcie_latency_us: float = 5.0,
    ) -> None: ...
    @property
    def nodes(self) -> int: ...
    @property
    def gpus_per_node(self) -> int: ...
    @property
    def slots(self) -> int: ...
    @property
    def num_gpus(self) -> int: ...
    @property
    def nvlink_gb_per_s(self) -> float: ...
    @property
    def network_gb_per_s(self) -> float: ...
    @property
    def pcie_gb_per_s(self) -> float: ...
    @property
    def nvlink_latency_us(self) -> float: ...
    @property
    def network_latency_us(self) -> float: ...
    @property
    def pcie_latency_us(self) -> float: ...
    def validate(self, num_experts: Optional[int] = None) -> None: ...

class Placement:
    @staticmethod
    def from_array(topology: Topology, gpu_slots: npt.NDArray[np.int32], num_experts: int) -> "Placement": ...
    @property
    def topology(self) -> Topology: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def gpu_slots(self) -> npt.NDArray[np.int32]: ...
    def validate(self) -> None: ...
    def __eq__(self, other: object) -> bool: ...

class Plan:
    num_layers: int
    num_gpus: int
    slots: int
    num_experts: int
    planner_seconds: float
    @property
    def topology(self) -> Topology: ...
    @property
    def placement(self) -> Placement: ...
    @property
    def gpu_slots(self) -> npt.NDArray[np.int32]:
        """[L, G, S] logical expert per physical slot, -1 empty."""
    @property
    def phys_to_log(self) -> npt.NDArray[np.int32]:
        """[L, G * S] the same as gpu_slots, flat per layer."""
    @property
    def slot_tokens(self) -> npt.NDArray[np.int64]:
        """[L, G, S] tokens sent to each physical slot."""
    @property
    def gpu_loads(self) -> npt.NDArray[np.int64]: ...
    @property
    def log_to_phys_offsets(self) -> npt.NDArray[np.int32]:
        """[L, E + 1] CSR offsets: copies of expert e are log_to_phys[l, off[l, e]:off[l, e + 1]]."""
    @property
    def log_to_phys(self) -> npt.NDArray[np.int32]:
        """[L, G * S] physical slots of each expert's copies (CSR, -1 past the end)."""
    @property
    def replica_count(self) -> npt.NDArray[np.int32]: ...
    @property
    def owner_gpu(self) -> npt.NDArray[np.int32]: ...
    @property
    def moves(self) -> npt.NDArray[np.int32]:
        """[N, 5] (layer, expert, src_gpu or -1 for the host mirror, dst_gpu, dst_slot)."""
    @property
    def imbalance(self) -> npt.NDArray[np.float64]: ...
    @property
    def max_gpu_load(self) -> npt.NDArray[np.int64]: ...
    @property
    def num_moves(self) -> int: ...
    def map_tokens(self, routed_experts: Any, layer_map: Optional[Sequence[int]] = None) -> npt.NDArray[np.int32]:
        """[T, L_trace, K] physical slot (gpu * slots + slot) of every routed id; -1 for no route and dense layers."""
    def source_split(self, layer: int, source_loads: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """[G * S, G] tokens each physical slot takes from each source rank, from the layer's [E, G] per-source
        loads (a copy on the source's rank first, then on its node, then anywhere)."""
    def dispatch(
        self, layer: int, routed_experts: Any, split: npt.NDArray[np.int64], rank: int, rule: str = "positional"
    ) -> Dict[str, Any]:
        """Rank `rank`'s [T, 1, K] ids through the layer's placement with its column of the [G * S, G] split:
        slots [T, K] int32 (-1 = no route), order / send_tokens / send_experts (routes sorted by slot: the send
        order, their tokens and logical experts), route_pos [T * K] (the send position of each route, -1 = none),
        input_splits / output_splits [G], slot_counts [S], recv_perm / recv_inverse (received rows grouped by
        local slot). `rule`: positional (copies in slot order take consecutive occurrences, as the runtime's
        device map) or node_affine (a token to the copy on a node, then a GPU, it already visits; the same
        counts, so the splits and the receive side are the same)."""
    def dispatch_loads(
        self, layer: int, routed_experts: Any, source_loads: npt.NDArray[np.int64], rank: int
    ) -> Dict[str, Any]:
        """`dispatch` with the split made from the layer's [E, G] int64 per-source loads (C order), as
        `source_split` makes it: the same dict plus `split` [G * S, G]."""
    def transfers(
        self,
        resident: Optional[Placement] = None,
        *,
        expert_bytes: int,
        max_chunk_bytes: int = 64 << 20,
        split_paths: bool = True,
        host_mirror: bool = True,
        allow_network: bool = True,
    ) -> Dict[str, Any]:
        """Transfer plan of every layer's moves from `resident` (None: owner copies only): `chunks` [N, 11] int64
        (columns in `chunk_columns`; path 0 nvlink, 1 pcie, 2 network), `est_seconds`, `link_bound_seconds`,
        `num_rounds` per layer and `path_bytes` [L, 3]."""

class HeldGradients:
    """Replica gradients held in place over an update stage (`plan/held_gradients.hpp`), chained through
    `Planner.plan(..., held=)`."""
    def __init__(self, layers: int, gpus: int, experts: int) -> None: ...
    num_layers: int
    num_gpus: int
    num_experts: int
    def count(self, layer: int) -> int: ...
    def clear(self) -> None: ...

class Planner:
    def __init__(self, topology: Topology, options: str) -> None: ...
    topology: Topology
    strategy: str
    move_budget: Optional[int]
    threads: int
    last_planner_seconds: float
    def plan_step(
        self,
        loads: npt.NDArray[np.int64],
        resident: Optional[Placement],
        previous_loads: Optional[npt.NDArray[np.int64]],
        stage: str,
        owners: Optional[npt.NDArray[np.int32]] = None,
        held: Optional[HeldGradients] = None,
    ) -> List[Plan]: ...
    def _bench_cpp_plan(self, loads: npt.NDArray[np.int64], resident: Optional[Placement], iters: int) -> float: ...

def simulate(
    config: Optional[str],
    flags: List[Tuple[str, str]],
    loads: Optional[npt.NDArray[np.int64]],
    step_offsets: Optional[npt.NDArray[np.int64]],
) -> str: ...
def simulate_settings(config: Optional[str], flags: List[Tuple[str, str]]) -> str: ...
def simulate_text(config: Optional[str], flags: List[Tuple[str, str]], doc: str, csv: bool) -> Tuple[str, str]: ...
def options(command: str) -> str: ...
def strategy_names() -> List[str]: ...
def trace_formats() -> List[Dict[str, Any]]: ...
def detect_trace_format(path: str) -> str: ...
def read_trace(
    path: str,
    format: str,
    data: Optional[bytes],
    mask_path: Optional[str],
    mask_data: Optional[bytes],
    num_layers: int,
    topk: int,
) -> Tuple[str, npt.NDArray[Any], Optional[npt.NDArray[np.uint8]], Optional[npt.NDArray[np.int64]]]: ...
def batch_formats() -> List[Dict[str, Any]]: ...
def count_batch(
    format: str,
    who: str,
    arrays: List[Any],
    list_sizes: Optional[List[int]],
    mask: Any,
    micro_batches: Any,
    offsets: Optional[npt.NDArray[np.int64]],
    num_experts: int,
    layer_map: Optional[List[int]],
) -> Tuple[Optional[npt.NDArray[np.int64]], Optional[List[Tuple[Any, ...]]], int, int]: ...
def plan_settings(flags: List[Tuple[str, str]]) -> str: ...
def plan_document(plans: List[Plan]) -> str: ...
def placement_document(placement: Placement) -> str: ...
def read_placement(text: str, source: str, topology: Topology, num_layers: int, num_experts: int) -> Placement: ...
def synthetic_trace(config: str) -> Dict[str, Any]: ...
def synthetic_loads(config: str, by_source: bool) -> Dict[str, Any]: ...

# The compiled runtime (runtime_ext.cpp); use foremoe.torch.engine.

class FaultSchedule:
    fail_probability: float
    corrupt_probability: float
    delay_probability: float
    delay_us: int
    fail_paths: List[str]
    seed: int
    def __init__(self, **fields: Any) -> None: ...
    @staticmethod
    def fields() -> List[str]: ...
    def draw(self, identity: List[int], decision: str) -> float: ...

class EngineOptions:
    backend: str
    transport: str
    topology: Topology
    num_layers: int
    num_experts: int
    tensors: List[Tuple[int, int]]
    expert_bytes: int
    max_chunk_bytes: int
    align_bytes: int
    split_paths: bool
    host_mirror: bool
    allow_network: bool
    max_attempts: int
    verify: bool
    host_threads_per_path: int
    cuda_device_of_gpu: List[int]
    faults: Optional[FaultSchedule]
    def __init__(self, **fields: Any) -> None: ...
    @staticmethod
    def fields() -> List[str]: ...

class HostEvent:
    def __init__(self) -> None: ...
    def set(self) -> None: ...
    def is_set(self) -> bool: ...

class Ticket:
    @property
    def state(self) -> str: ...
    @property
    def backend(self) -> str: ...
    def status(self) -> Tuple[str, str]: ...
    def wait(self, timeout: float) -> Tuple[str, str]: ...
    def abort(self) -> None: ...
    def enqueue_wait(self, stream: int) -> Tuple[str, str]: ...
    def telemetry(self) -> List[Dict[str, Any]]: ...

class TransferEngine:
    def __init__(self, options: EngineOptions) -> None: ...
    @property
    def options(self) -> EngineOptions: ...
    def register_slots(self, layer: int, gpu: int, slots: Any, num_buffers: int = 1) -> None: ...
    def register_mirror(self, layer: int, node: int, mirror: Any) -> None: ...
    def register_grads(self, layer: int, gpu: int, grads: Any, grad_bytes: Optional[int] = None) -> None: ...
    def set_resident(self, layer: int, gpu_slots: npt.NDArray[np.int32]) -> None: ...
    def resident(self, layer: int) -> npt.NDArray[np.int32]: ...
    def submit(self, layer: int, moves: npt.NDArray[np.int32], sources_ready: Any, slots_free: Any,
               dst_buffer: int, timeout: float) -> Ticket: ...
    def submit_reduce(self, layer: int, owner_gpu: npt.NDArray[np.int32], grads_ready: Any,
                      timeout: float, returns: Optional[npt.NDArray[np.int32]] = None,
                      held: Optional[npt.NDArray[np.int32]] = None) -> Ticket: ...
    def valid_expert(self, layer: int, gpu: int, slot: int) -> int: ...
    def last_plan(self, layer: int) -> Dict[str, Any]: ...
    def stats(self) -> Dict[str, int]: ...

def routes_from_map(routing_map: Any, topk: int, ids: Any, counts: Any) -> int: ...
def runtime_build_info() -> Dict[str, Any]: ...
def runtime_count_loads(ids: Any, out: Any, num_experts: int, microbatch_offsets: Optional[npt.NDArray[np.int64]],
                        layer_map: Optional[Sequence[int]], num_threads: int, stream: int, timeout_ms: int) -> None: ...
def runtime_map_tokens(ids: Any, out: Any, layer_idx: int, num_experts: int, slot_expert: npt.NDArray[np.int32],
                       slot_tokens: npt.NDArray[np.int64], num_sources: int,
                       source_offsets: Optional[npt.NDArray[np.int64]], stream: int, timeout_ms: int) -> None: ...

def pack_micro_batches(
    lengths: Any, histograms: Any, micro_steps: int, ranks: int, token_budget: int, gpu_of: Any, gpus: int,
    start_micro_step: Any, start_rank: Any, max_passes: int, search_work: int
) -> Tuple[Any, Any, float, float]: ...
def pack_by_tokens(lengths: Any, micro_steps: int, ranks: int, token_budget: int) -> Tuple[Any, Any]: ...
