// Device benchmark of the transfer engine (run by scripts/device-check.sh on a machine with a GPU): move bandwidth
// of both paths through the engine against plain cudaMemcpyAsync of the same bytes, and the slowdown of a cuBLAS GEMM
// while moves run on the engine's side streams. Prints a table and, with --json FILE, the figures as JSON.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "foremoe/runtime/transfer_engine.hpp"

namespace rt = foremoe::runtime;
using namespace std::chrono_literals;

#define CHECK_CUDA(x)                                                                                                  \
  do {                                                                                                                 \
    cudaError_t e_ = (x);                                                                                              \
    if (e_ != cudaSuccess) {                                                                                           \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_));                                             \
      std::exit(1);                                                                                                    \
    }                                                                                                                  \
  } while (0)

namespace {

constexpr std::int64_t expert_bytes = 3 * 7168LL * 2048; // a DeepSeek-V3 expert in fp8
constexpr int num_moves = 16;

double plain_copy_gbps(void *dst, const void *src, std::int64_t bytes, int reps) {
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  CHECK_CUDA(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(bytes), cudaMemcpyDefault, s)); // warm-up
  CHECK_CUDA(cudaEventRecord(a, s));
  for (int r = 0; r < reps; ++r)
    CHECK_CUDA(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(bytes), cudaMemcpyDefault, s));
  CHECK_CUDA(cudaEventRecord(b, s));
  CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(s);
  return static_cast<double>(bytes) * reps / (ms * 1e-3) / 1e9;
}

// Two logical GPUs on device 0: GPU 0 holds experts 0..15 in its slots, GPU 1 receives them. With the mirror only
// the moves go host -> device; without the mirror they go device -> device.
struct Rig {
  void *gpu0 = nullptr, *gpu1 = nullptr, *mirror = nullptr;
  std::unique_ptr<rt::TransferEngine> engine;
  explicit Rig(bool use_mirror) {
    rt::EngineOptions o;
    o.backend = rt::Backend::cuda;
    o.topology = {1, 2, num_moves};
    o.num_experts = num_moves;
    o.tensors = {{0, expert_bytes}};
    o.cuda_device_of_gpu = {0, 0};
    o.planning.max_chunk_bytes = expert_bytes; // one chunk per move, as the plain copy
    o.planning.host_mirror = use_mirror;
    if (rt::Status st = rt::TransferEngine::create(o, engine); !st.ok()) {
      std::fprintf(stderr, "engine: %s\n", st.to_string().c_str());
      std::exit(1);
    }
    const std::size_t total = static_cast<std::size_t>(expert_bytes) * num_moves;
    CHECK_CUDA(cudaMalloc(&gpu0, total));
    CHECK_CUDA(cudaMalloc(&gpu1, total));
    CHECK_CUDA(cudaMallocHost(&mirror, total));
    std::memset(mirror, 1, total);
    (void)engine->register_slots(0, 0, {gpu0, expert_bytes, num_moves, 1, 0});
    (void)engine->register_slots(0, 1, {gpu1, expert_bytes, num_moves, 1, 0});
    (void)engine->register_mirror(0, 0, {mirror, expert_bytes, num_moves});
  }
  ~Rig() {
    engine.reset();
    cudaFree(gpu0);
    cudaFree(gpu1);
    cudaFreeHost(mirror);
  }
  // Wall seconds of one batch of 16 moves into GPU 1 (from the mirror when GPU 0 holds nothing, else from GPU 0).
  double batch_seconds(bool gpu0_holds) {
    foremoe::LayerPlacement p(2, num_moves, num_moves);
    if (gpu0_holds)
      for (int e = 0; e < num_moves; ++e)
        p.slot(0, e) = e;
    (void)engine->set_resident(0, p);
    std::vector<foremoe::Move> moves;
    for (int e = 0; e < num_moves; ++e)
      moves.push_back({e, foremoe::host_mirror, 1, e});
    rt::MoveBatch mb;
    mb.moves = moves;
    rt::Ticket t;
    const auto t0 = std::chrono::steady_clock::now();
    if (rt::Status st = engine->submit(mb, t); !st.ok()) {
      std::fprintf(stderr, "submit: %s\n", st.to_string().c_str());
      std::exit(1);
    }
    if (rt::Status st = t.wait_for(60s); !st.ok()) {
      std::fprintf(stderr, "batch: %s\n", st.to_string().c_str());
      std::exit(1);
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

double best_engine_gbps(Rig &rig, bool gpu0_holds, int reps) {
  double best = 1e30;
  (void)rig.batch_seconds(gpu0_holds); // warm-up
  for (int r = 0; r < reps; ++r)
    best = std::min(best, rig.batch_seconds(gpu0_holds));
  return static_cast<double>(expert_bytes) * num_moves / best / 1e9;
}

// Milliseconds per GEMM (bf16, n x n x n) over `iters` iterations.
double gemm_ms(cublasHandle_t h, cudaStream_t s, int n, void *a, void *b, void *c, int iters) {
  const float one = 1.0f, zero = 0.0f;
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  CHECK_CUDA(cudaEventRecord(e0, s));
  for (int i = 0; i < iters; ++i)
    cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n, &zero, c,
                 CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  CHECK_CUDA(cudaEventRecord(e1, s));
  CHECK_CUDA(cudaEventSynchronize(e1));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms / iters;
}

} // namespace

int main(int argc, char **argv) {
  std::string json_path;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--json") == 0) json_path = argv[i + 1];
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::puts("device_bench_transfer: no CUDA device, skipped");
    return 77;
  }
  CHECK_CUDA(cudaSetDevice(0));
  const std::int64_t total = expert_bytes * num_moves;

  Rig h2d(true), d2d(false);
  const double plain_h2d = plain_copy_gbps(h2d.gpu1, h2d.mirror, total, 5);
  const double plain_d2d = plain_copy_gbps(d2d.gpu1, d2d.gpu0, total, 5);
  const double eng_h2d = best_engine_gbps(h2d, false, 5);
  const double eng_d2d = best_engine_gbps(d2d, true, 5);

  // Compute slowdown: GEMMs alone, then with moves of both paths running on the engine's streams.
  cublasHandle_t h;
  cublasCreate(&h);
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cublasSetStream(h, s);
  const int n = 8192;
  void *a, *b, *c;
  CHECK_CUDA(cudaMalloc(&a, std::size_t(n) * n * 2));
  CHECK_CUDA(cudaMalloc(&b, std::size_t(n) * n * 2));
  CHECK_CUDA(cudaMalloc(&c, std::size_t(n) * n * 2));
  CHECK_CUDA(cudaMemset(a, 0, std::size_t(n) * n * 2));
  CHECK_CUDA(cudaMemset(b, 0, std::size_t(n) * n * 2));
  (void)gemm_ms(h, s, n, a, b, c, 3);
  const double alone = gemm_ms(h, s, n, a, b, c, 40);
  std::atomic<bool> stop{false};
  int batches = 0;
  std::thread mover([&] {
    while (!stop) {
      (void)h2d.batch_seconds(false);
      (void)d2d.batch_seconds(true);
      batches += 2;
    }
  });
  std::this_thread::sleep_for(5ms);
  const double with_moves = gemm_ms(h, s, n, a, b, c, 40);
  stop = true;
  mover.join();
  const double slowdown = with_moves / alone - 1.0;

  std::printf("\n%-34s %12s %12s %8s %8s\n", "figure", "engine", "plain", "ratio", "target");
  std::printf("%-34s %9.1f GB/s %7.1f GB/s %7.1f%% %8s\n", "host->device (pinned mirror)", eng_h2d, plain_h2d,
              100 * eng_h2d / plain_h2d, ">=90%");
  std::printf("%-34s %9.1f GB/s %7.1f GB/s %7.1f%% %8s\n", "device->device", eng_d2d, plain_d2d,
              100 * eng_d2d / plain_d2d, ">=90%");
  std::printf("%-34s %9.3f ms %9.3f ms %7.1f%% %8s\n", "bf16 GEMM 8192^3 with moves beside", with_moves, alone,
              100 * slowdown, "<=10%");
  std::printf("(%d move batches of %d x %.1f MB ran beside the GEMMs)\n", batches, num_moves, expert_bytes / 1e6);
  if (!json_path.empty()) {
    std::ofstream j(json_path);
    j << "{\"h2d_engine_gbps\": " << eng_h2d << ", \"h2d_plain_gbps\": " << plain_h2d
      << ", \"d2d_engine_gbps\": " << eng_d2d << ", \"d2d_plain_gbps\": " << plain_d2d
      << ", \"gemm_ms_alone\": " << alone << ", \"gemm_ms_with_moves\": " << with_moves
      << ", \"compute_slowdown\": " << slowdown << "}\n";
  }
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  cublasDestroy(h);
  cudaStreamDestroy(s);
  return 0;
}
