// SPDX-License-Identifier: Apache-2.0
// FlashInfer's MLA paged decode behind C entry points, for the GPU check's
// MLA cases (scripts/baseline/flashinfer_mla.py loads them with ctypes: the
// GPU machine has neither FlashInfer's Python package nor vLLM, only torch).
// What vLLM's FLASHINFER_MLA backend runs through flashinfer-python
// 0.7.0.post1's BatchMLAPagedAttentionWrapper, here its Hopper kernel
// (BatchMLAPageAttentionHopper, attention/mla_hopper.cuh) and its host
// planner (MLAPlan, attention/scheduler.cuh), both header-only templates:
//
//  - flashinfer_mla_plan: the planner on the host for one batch's lengths;
//    it stages the plan's arrays in a pinned buffer, copies them to the int
//    workspace on the stream (async: the caller synchronizes before the
//    pinned buffer can go) and returns the plan's 18 offsets.
//  - flashinfer_mla_run: the attention of q_latent [n, heads, 512] and q_pe
//    [n, heads, 64] over the paged latent cache, read in place: each row
//    [kv_c | k_pe] of vLLM's MLA cache (576 bf16), kv_c at offset 0 and
//    k_pe at offset 512, rows `row_stride` elements apart, pages
//    `page_stride` apart; o [n, heads, 512] bf16, lse [n, heads] fp32 (or
//    null).
//
// Each returns a cudaError_t (0: success) and never throws: FlashInfer's
// host errors become cudaErrorInvalidValue (an exception must not cross
// ctypes).
#include <flashinfer/attention/mla_hopper.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/fastdiv.cuh>

#include <exception>

using namespace flashinfer;

// (A named namespace: a kernel's template argument types must not be in an
// anonymous one, or nvcc's host stubs fail to name them.)
namespace vllm_megakernel_baseline_mla {

using DType = nv_bfloat16;
using IdType = int32_t;
using Params = MLAParams<DType, DType, DType, IdType>;
constexpr uint32_t HEAD_DIM_CKV = 512;
constexpr uint32_t HEAD_DIM_KPE = 64;
constexpr int PLAN_FIELDS = 18;

}  // namespace vllm_megakernel_baseline_mla

using namespace vllm_megakernel_baseline_mla;

#define EXPORT extern "C" __attribute__((visibility("default")))

EXPORT int flashinfer_mla_plan(void* float_ws, size_t float_bytes, void* int_ws,
                               void* int_ws_host, size_t int_bytes, int64_t* plan_out,
                               const int32_t* qo_indptr_h, const int32_t* kv_indptr_h,
                               const int32_t* kv_len_h, uint32_t batch, uint32_t num_heads,
                               void* stream) {
  try {
    MLAPlanInfo info;
    size_t staged = 0;
    cudaError_t err = MLAPlan<IdType>(
        float_ws, float_bytes, int_ws, int_ws_host, int_bytes, info, staged,
        const_cast<IdType*>(qo_indptr_h), const_cast<IdType*>(kv_indptr_h),
        const_cast<IdType*>(kv_len_h), batch, num_heads, HEAD_DIM_CKV, /*causal=*/false,
        static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) return err;
    // MLAPlan (0.7) only stages the arrays on the host and reports how many
    // bytes: FlashInfer's Python caller copies them to the device
    // (jit/attention/modules.py, _BatchMLAModuleProxy). Without this copy the
    // kernel reads an uninitialized work list (an illegal address on H200).
    if (staged == 0 || staged > int_bytes) return cudaErrorInvalidValue;
    err = cudaMemcpyAsync(int_ws, int_ws_host, staged, cudaMemcpyHostToDevice,
                          static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) return err;
    const std::vector<int64_t> v = info.ToVector();
    if (static_cast<int>(v.size()) != PLAN_FIELDS) return cudaErrorInvalidValue;
    for (int i = 0; i < PLAN_FIELDS; ++i) plan_out[i] = v[i];
    return cudaSuccess;
  } catch (const std::exception&) {
    return cudaErrorInvalidValue;
  }
}

EXPORT int flashinfer_mla_run(void* float_ws, void* int_ws, const int64_t* plan_in,
                              void* q_latent, void* q_pe, void* cache, int32_t* kv_indices,
                              void* o, float* lse, uint32_t num_heads, uint32_t page_size,
                              uint32_t q_stride_n, uint32_t q_stride_h, uint32_t pe_stride_n,
                              uint32_t pe_stride_h, uint32_t page_stride, uint32_t row_stride,
                              float sm_scale, void* stream) {
  try {
    MLAPlanInfo info;
    info.FromVector(std::vector<int64_t>(plan_in, plan_in + PLAN_FIELDS));
    Params p;
    p.q_nope = static_cast<DType*>(q_latent);
    p.q_pe = static_cast<DType*>(q_pe);
    p.ckv = static_cast<DType*>(cache);
    p.kpe = static_cast<DType*>(cache) + HEAD_DIM_CKV;
    p.q_indptr = GetPtrFromBaseOffset<IdType>(int_ws, info.q_indptr_offset);
    p.kv_indptr = GetPtrFromBaseOffset<IdType>(int_ws, info.kv_indptr_offset);
    p.partial_indptr = GetPtrFromBaseOffset<IdType>(int_ws, info.partial_indptr_offset);
    p.kv_indices = kv_indices;
    p.q_len = GetPtrFromBaseOffset<IdType>(int_ws, info.q_len_offset);
    p.kv_len = GetPtrFromBaseOffset<IdType>(int_ws, info.kv_len_offset);
    p.q_start = GetPtrFromBaseOffset<IdType>(int_ws, info.q_start_offset);
    p.kv_start = GetPtrFromBaseOffset<IdType>(int_ws, info.kv_start_offset);
    p.kv_end = GetPtrFromBaseOffset<IdType>(int_ws, info.kv_end_offset);
    p.work_indptr = GetPtrFromBaseOffset<IdType>(int_ws, info.work_indptr_offset);
    p.merge_packed_offset_start =
        GetPtrFromBaseOffset<IdType>(int_ws, info.merge_packed_offset_start_offset);
    p.merge_packed_offset_end =
        GetPtrFromBaseOffset<IdType>(int_ws, info.merge_packed_offset_end_offset);
    p.merge_partial_packed_offset_start =
        GetPtrFromBaseOffset<IdType>(int_ws, info.merge_partial_packed_offset_start_offset);
    p.merge_partial_packed_offset_end =
        GetPtrFromBaseOffset<IdType>(int_ws, info.merge_partial_packed_offset_end_offset);
    p.merge_partial_stride =
        GetPtrFromBaseOffset<IdType>(int_ws, info.merge_partial_stride_offset);
    p.final_o = static_cast<DType*>(o);
    p.final_lse = lse;
    p.partial_o = GetPtrFromBaseOffset<DType>(float_ws, info.partial_o_offset);
    p.partial_lse = GetPtrFromBaseOffset<float>(float_ws, info.partial_lse_offset);
    p.num_heads = uint_fastdiv(num_heads);
    p.block_size = uint_fastdiv(page_size);
    p.q_nope_stride_n = q_stride_n;
    p.q_nope_stride_h = q_stride_h;
    p.q_pe_stride_n = pe_stride_n;
    p.q_pe_stride_h = pe_stride_h;
    p.ckv_stride_page = page_stride;
    p.ckv_stride_n = row_stride;
    p.kpe_stride_page = page_stride;
    p.kpe_stride_n = row_stride;
    p.o_stride_n = num_heads * HEAD_DIM_CKV;
    p.o_stride_h = HEAD_DIM_CKV;
    // The log-sum-exp in natural log units, as the megakernel's partials.
    p.return_lse_base_on_e = true;
    p.sm_scale = sm_scale;
    return mla::BatchMLAPageAttentionHopper<MaskMode::kNone, HEAD_DIM_CKV, HEAD_DIM_KPE>(
        p, info.num_blks_x, info.num_blks_y, static_cast<cudaStream_t>(stream));
  } catch (const std::exception&) {
    return cudaErrorInvalidValue;
  }
}
