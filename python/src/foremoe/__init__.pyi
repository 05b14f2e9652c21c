"""Type stub of the public `foremoe` API."""

from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union, overload

import numpy as np
import numpy.typing as npt

from ._core import HeldGradients as HeldGradients, Placement as Placement, Plan as Plan, Topology as Topology

__version__: str
STRATEGIES: Tuple[str, ...]
SIM_STRATEGIES: Tuple[str, ...]
TRACE_FORMATS: Tuple[str, ...]

def count_loads(
    routed_experts: Any,
    microbatch_offsets: Optional[Sequence[int]] = None,
    *,
    num_experts: int,
    layer_map: Optional[Sequence[int]] = None,
    num_sources: int = 0,
    source_offsets: Optional[Sequence[int]] = None,
    return_by_source: bool = False,
    mask: Any = None,
    format: str = "auto",
    num_layers: int = 0,
    topk: int = 0,
) -> Any:
    """[T, L, K] routed ids (any int dtype, -1 = no route) -> [M, L, E] int64 loads; mask 0 = not counted."""

class TraceRecord(NamedTuple):
    format: str
    ids: npt.NDArray[Any]
    mask: Optional[npt.NDArray[np.uint8]]
    request_offsets: Optional[npt.NDArray[np.int64]]

def trace_formats() -> List[Dict[str, Any]]: ...
def read_trace(source: Any, format: str = "auto", *, mask: Any = None, num_layers: int = 0, topk: int = 0) -> TraceRecord: ...
def read_verl(routed_experts: Any, attention_mask: Any = None) -> Tuple[npt.NDArray[Any], Optional[npt.NDArray[np.uint8]]]: ...
def read_sglang(source: Any, num_layers: int, topk: int) -> Tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]: ...
def rebalance_experts(
    weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> Tuple[Any, Any, Any]:
    """DeepSeek EPLB's call: float weights [L, E] -> (phy2log [L, R], log2phy [L, E, maxcnt] (-1 padded), logcnt [L, E])."""
def export_placement(placement: Any, path: Any, format: str = "sglang", num_experts: Optional[int] = None) -> None: ...

class MicroBatchPacking(NamedTuple):
    micro_step: npt.NDArray[np.int32]
    rank: npt.NDArray[np.int32]
    start_deviation: float
    deviation: float
    def micro_batches(self, micro_steps: int, ranks: int = 1) -> List[List[List[int]]]: ...

def pack_by_tokens(lengths: Any, *, micro_steps: int, token_budget: int, ranks: int = 1) -> Tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]: ...
def sequence_histograms(routed_ids: Any, lengths: Any, num_experts: int) -> npt.NDArray[np.int64]: ...
def pack_micro_batches(
    lengths: Any, histograms: Any, *, micro_steps: int, token_budget: int, ranks: int = 1, gpu_of: Any = None,
    start: Optional[Tuple[Any, Any]] = None, max_passes: int = 8, search_work: int = -1
) -> MicroBatchPacking: ...

class Planner:
    topology: Topology
    def __init__(
        self,
        topology: Topology,
        strategy: Optional[str] = None,
        move_budget: Optional[int] = None,
        threads: Optional[int] = None,
        *,
        hierarchical_owners: Optional[bool] = None,
        reowning_free: Optional[bool] = None,
        owner_keep_tolerance: Optional[float] = None,
        local_search_rounds: Optional[int] = None,
        free_search_rounds: Optional[int] = None,
        exact_split: Optional[bool] = None,
        tolerance: Optional[float] = None,
        gradient_bytes_factor: Optional[float] = None,
        hold_replica_gradients: Optional[bool] = None,
        min_tokens_per_replica: Optional[int] = None,
        ultraep_min_tokens: Optional[int] = None,
        peer_domain_gpus: Optional[int] = None,
        eplb_num_groups: Optional[int] = None,
        eplb_interval: Optional[int] = None,
    ) -> None:
        """None takes the library default (foremoe.options("planner"))."""
    @property
    def strategy(self) -> str: ...
    @property
    def move_budget(self) -> Optional[int]: ...
    @property
    def threads(self) -> int: ...
    @property
    def last_planner_seconds(self) -> float: ...
    def plan(
        self,
        loads: Any,
        resident: Union[None, Plan, Placement, npt.ArrayLike] = None,
        *,
        previous_loads: Any = None,
        stage: str = "update",
        owners: Any = None,
        held: Optional[HeldGradients] = None,
    ) -> Union[Plan, List[Plan]]:
        """[L, E] loads -> Plan; [M, L, E] -> list of Plans (one per micro-step)."""

def simulate(
    config: Optional[Mapping[str, Any]] = None,
    loads: Any = None,
    step_offsets: Optional[Sequence[int]] = None,
    strategies: Union[None, str, Sequence[str]] = None,
) -> Dict[str, Any]: ...
def options(command: str = "simulate") -> List[Dict[str, Any]]: ...
def simulate_config(config: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]: ...
def plan_document(plans: Union[Plan, Sequence[Plan]]) -> Dict[str, Any]: ...
def synthetic_trace(**config: Any) -> Dict[str, Any]: ...
def synthetic_loads(*, by_source: bool = False, **config: Any) -> Dict[str, Any]: ...
