// GEMMs for Hopper (sm_90a) on CUTLASS 3: FP8 (e4m3) with a scale per row of A and per row of B,
// or bf16 without scales.
//
//   FP8:  D[m, n] = bf16( scale_a[m] * (scale_b[n] * sum_k A[m, k] * B[n, k]) )
//   bf16: D[m, n] = bf16( sum_k A[m, k] * B[n, k] )          (float32 accumulation)
//
// A [M, K] row-major (activations; for FP8 quantized per row), B [N, K] row-major (the weight as
// stored: K-major, CUTLASS's column-major K x N), D [M, N] row-major bf16. FP8's scales are
// float32 and applied in the epilogue (an epilogue visitor tree: the accumulator times a row
// broadcast of scale_b, times a column broadcast of scale_a), with tensor-core accumulation
// without the periodic float32 promotion (the FP8FastAccum schedules), as phalanx's cuBLASLt path
// (fp8.FAST_ACCUM). bf16 (PHALANX_BF16=1) takes the plain warp-specialized schedules and an
// epilogue that only converts; its scale arguments are ignored (pass null).
//
// One configuration per translation unit, chosen by the defines that kernels/cutlass_gemm.py
// passes (the element type, the tile, the cluster, the schedule); each exports two C functions
// named after it:
//   size_t phalanx_gemm_<NAME>_workspace(int M, int N, int K)
//   int    phalanx_gemm_<NAME>(a, b, d, scale_a, scale_b, M, N, K, workspace, stream)
// which return 0, or a nonzero status where CUTLASS cannot run the problem (alignment: rows of
// 16 bytes, so K a multiple of 16 in FP8 and of 8 in bf16, N of 8; phalanx calls it where K and
// N are multiples of 16).

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#ifndef PHALANX_NAME
#error "define PHALANX_NAME, PHALANX_BF16, PHALANX_TILE_M/N/K, PHALANX_CLUSTER_M/N and PHALANX_PINGPONG"
#endif

#define PHALANX_CAT2(a, b) a##b
#define PHALANX_CAT(a, b) PHALANX_CAT2(a, b)
#define PHALANX_FN(suffix) PHALANX_CAT(PHALANX_CAT(phalanx_gemm_, PHALANX_NAME), suffix)

namespace {

using namespace cute;

#if PHALANX_BF16
using ElementA = cutlass::bfloat16_t;
using ElementB = cutlass::bfloat16_t;
constexpr int kAlignAB = 8;    // elements of 2 bytes: 16-byte TMA rows
#else
using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
constexpr int kAlignAB = 16;   // elements of 1 byte: 16-byte TMA rows
#endif
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignD = 8;     // bf16

using TileShape = Shape<Int<PHALANX_TILE_M>, Int<PHALANX_TILE_N>, Int<PHALANX_TILE_K>>;
using ClusterShape = Shape<Int<PHALANX_CLUSTER_M>, Int<PHALANX_CLUSTER_N>, _1>;

#if PHALANX_PINGPONG && PHALANX_BF16
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
#elif PHALANX_PINGPONG
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;
#elif PHALANX_BF16
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
#else
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum;
#endif
#if PHALANX_PINGPONG
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
#else
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#endif

namespace fusion = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

#if PHALANX_BF16
// the accumulator converted to bf16
using Epilogue = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::epilogue::thread::Identity, ElementD, float, kRound>,
                                 fusion::Sm90AccFetch>;
#else
// scale_b: one value per output column n (a row vector broadcast down the rows)
using ScaleB = fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, _1, _0>>;
// scale_a: one value per output row m (a column vector broadcast across the columns)
using ScaleA = fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<_1, _0, _0>>;
using TimesScaleB = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                                    ScaleB, fusion::Sm90AccFetch>;
using Epilogue = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, ElementD, float, kRound>,
                                 ScaleA, TimesScaleB>;
#endif

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, LayoutD, kAlignD,          // no C operand
    ElementD, LayoutD, kAlignD, EpilogueSchedule, Epilogue>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlignAB, ElementB, LayoutB, kAlignAB,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    MainloopSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                        CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

typename Gemm::Arguments arguments(const void* a, const void* b, void* d, const float* scale_a,
                                   const float* scale_b, int M, int N, int K) {
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, make_shape(M, K, 1));
  StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, make_shape(N, K, 1));
  StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, make_shape(M, N, 1));
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {M, N, K, 1},
      {static_cast<const ElementA*>(a), stride_a, static_cast<const ElementB*>(b), stride_b},
      {{},   // the epilogue tree's arguments, below
       nullptr, stride_d, static_cast<ElementD*>(d), stride_d}};
#if PHALANX_BF16
  (void)scale_a;
  (void)scale_b;
  args.epilogue.thread = {{}, {}};    // Identity(AccFetch): nothing to pass
#else
  // Epilogue = multiplies(ScaleA, TimesScaleB(ScaleB, acc)): children first, the node's op last
  args.epilogue.thread = {
      {scale_a},                      // ScaleA
      {{scale_b}, {}, {}},            // TimesScaleB: ScaleB, AccFetch, multiplies
      {}};                            // multiplies
#endif
  // the persistent scheduler's grid: the SM count, asked of the driver once per device
  static int sm_counts[64] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (device >= 0 && device < 64) {
    if (sm_counts[device] == 0) cudaDeviceGetAttribute(&sm_counts[device], cudaDevAttrMultiProcessorCount, device);
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_counts[device];
  }
  return args;
}

}  // namespace

extern "C" size_t PHALANX_FN(_workspace)(int M, int N, int K) {
  auto args = arguments(nullptr, nullptr, nullptr, nullptr, nullptr, M, N, K);
  return Gemm::get_workspace_size(args);
}

extern "C" int PHALANX_FN()(const void* a, const void* b, void* d, const float* scale_a, const float* scale_b,
                            int M, int N, int K, void* workspace, cudaStream_t stream) {
  auto args = arguments(a, b, d, scale_a, scale_b, M, N, K);
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) return 1 + static_cast<int>(status);
  status = gemm.initialize(args, workspace, stream);
  if (status != cutlass::Status::kSuccess) return 100 + static_cast<int>(status);
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) return 200 + static_cast<int>(status);
  return 0;
}
