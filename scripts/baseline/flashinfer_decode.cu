// SPDX-License-Identifier: Apache-2.0
// The per-op baseline's attention kernels behind C entry points, for the GPU
// check (scripts/baseline/flashinfer_baseline.py loads them with ctypes: the
// GPU machine has neither FlashInfer's Python package nor vLLM, only torch):
//
//  - flashinfer_paged_decode_split: FlashInfer's paged decode attention
//    (its header-only CUDA template, as vLLM 0.32.0's flashinfer-python
//    0.7.0.post1 ships it) with split-KV: each request's KV cut into chunks
//    run by CTAs of their own, the partial outputs then merged by
//    FlashInfer's VariableLengthMergeStates. The plan (which chunk each work
//    item runs) comes from the caller, chosen as FlashInfer's DecodePlan
//    chooses it; flashinfer_decode_work_estimation runs FlashInfer's own
//    planner on the host so the caller can check its plan against it.
//  - flashinfer_paged_decode: the same kernel, one work item per request.
//  - kv_append: the new tokens' K and V written into the cache, one launch
//    per layer, as vLLM's reshape_and_cache_flash does.
//
// Every entry point reads and writes vLLM's FlashAttention cache layout in
// place: memory [block, token, kv_head, K|V], K at offset 0 and V at offset
// head_dim of each entry, bf16. Each returns a cudaError_t (0: success),
// never throws: an unsupported shape is cudaErrorInvalidValue.
#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/attention/variants.cuh>

using namespace flashinfer;

namespace vllm_megakernel_baseline {

using DTypeQ = nv_bfloat16;
using DTypeKV = nv_bfloat16;
using DTypeO = nv_bfloat16;
using IdType = int32_t;

struct Params {
  using DTypeQ = vllm_megakernel_baseline::DTypeQ;
  using DTypeKV = vllm_megakernel_baseline::DTypeKV;
  using DTypeO = vllm_megakernel_baseline::DTypeO;
  using IdType = vllm_megakernel_baseline::IdType;

  DTypeQ* q;
  paged_kv_t<DTypeKV, IdType> paged_kv;
  DTypeO* o;
  float* lse;
  float* maybe_alibi_slopes;
  double logits_soft_cap;
  double sm_scale;
  double rope_rcp_scale;
  double rope_rcp_theta;
  uint32_t padded_batch_size;
  uint32_t num_qo_heads;
  IdType q_stride_n;
  IdType q_stride_h;
  int32_t window_left;
  bool enable_pdl;
  IdType* request_indices;
  IdType* kv_tile_indices;
  IdType* o_indptr;
  IdType* kv_chunk_size_ptr;
  bool* block_valid_mask;
  bool partition_kv;

  __host__ __device__ __forceinline__ int32_t get_qo_len(int32_t) const { return 1; }
  __host__ __device__ __forceinline__ int32_t get_kv_len(int32_t batch_idx) const {
    return paged_kv.get_length(batch_idx);
  }
};

using Variant = DefaultAttention</*custom_mask=*/false, /*sliding_window=*/false,
                                 /*soft_cap=*/false, /*alibi=*/false>;

// The GQA group sizes FlashInfer's decode dispatches (DISPATCH_GQA_GROUP_SIZE
// throws on others: checked before, as an exception must not cross ctypes).
bool supported(int32_t q_heads, int32_t kv_heads, int32_t head_dim) {
  if (kv_heads <= 0 || q_heads % kv_heads != 0) return false;
  const int32_t group = q_heads / kv_heads;
  const bool group_ok = group == 1 || group == 2 || group == 3 || group == 4 || group == 6 ||
                        group == 8;
  return group_ok && (head_dim == 64 || head_dim == 128);
}

// No tmp_v / tmp_s: one work item per request, written straight to o.
// Otherwise FlashInfer's partition-kv path: the work items' partial outputs
// and log-sum-exps into tmp_v / tmp_s, merged per request into o.
int decode(void* q, void* cache, int32_t* indices, int32_t* indptr, int32_t* last_page_len,
           void* o, int32_t* request_indices, int32_t* kv_tile_indices, int32_t* o_indptr,
           int32_t* kv_chunk_size, void* tmp_v, float* tmp_s, int32_t batch, int32_t work_items,
           int32_t q_heads, int32_t kv_heads, int32_t head_dim, int32_t page_size,
           int64_t block_stride, int64_t q_stride_n, int64_t q_stride_h, float sm_scale,
           void* stream) {
  const bool split = tmp_v != nullptr && tmp_s != nullptr;
  if (!supported(q_heads, kv_heads, head_dim) || batch <= 0 || work_items < batch ||
      (!split && work_items != batch)) {
    return (int)cudaErrorInvalidValue;
  }
  auto* base = static_cast<DTypeKV*>(cache);
  // (page, token, head) strides of the NHD view FlashInfer reads.
  const int64_t strides[3] = {block_stride, (int64_t)kv_heads * 2 * head_dim, 2 * head_dim};
  Params p;
  p.q = static_cast<DTypeQ*>(q);
  p.paged_kv = paged_kv_t<DTypeKV, IdType>(kv_heads, page_size, head_dim, batch, QKVLayout::kNHD,
                                           base, base + head_dim, strides, indices, indptr,
                                           last_page_len);
  p.o = static_cast<DTypeO*>(o);
  p.lse = nullptr;
  p.maybe_alibi_slopes = nullptr;
  p.logits_soft_cap = 0.0;
  p.sm_scale = sm_scale;
  p.rope_rcp_scale = 1.0;
  p.rope_rcp_theta = 1.0;
  p.padded_batch_size = work_items;  // the grid's x: one CTA row per work item
  p.num_qo_heads = q_heads;
  p.q_stride_n = (IdType)q_stride_n;
  p.q_stride_h = (IdType)q_stride_h;
  p.window_left = -1;
  p.enable_pdl = false;
  p.request_indices = request_indices;
  p.kv_tile_indices = kv_tile_indices;
  p.o_indptr = o_indptr;
  p.kv_chunk_size_ptr = kv_chunk_size;
  p.block_valid_mask = nullptr;  // no padded work items: the plan is exact
  p.partition_kv = split;
  auto s = static_cast<cudaStream_t>(stream);
  auto* v = split ? static_cast<DTypeO*>(tmp_v) : nullptr;
  try {
    if (head_dim == 64) {
      return (int)BatchDecodeWithPagedKVCacheDispatched<64, PosEncodingMode::kNone, Variant,
                                                        Params>(p, v, tmp_s, false, s);
    }
    return (int)BatchDecodeWithPagedKVCacheDispatched<128, PosEncodingMode::kNone, Variant,
                                                      Params>(p, v, tmp_s, false, s);
  } catch (...) {
    return (int)cudaErrorInvalidValue;
  }
}

template <uint32_t HEAD_DIM>
cudaError_t estimate(bool& split, uint32_t& max_grid, uint32_t& chunk_pages, uint32_t& work_items,
                     int32_t* indptr_h, int32_t batch, int32_t q_heads, int32_t kv_heads,
                     int32_t page_size) {
  uint32_t gdy = 0;
  cudaError_t err = cudaErrorInvalidValue;
  DISPATCH_GQA_GROUP_SIZE(q_heads / kv_heads, GROUP_SIZE, {
    err = BatchDecodeWithPagedKVCacheWorkEstimationDispatched<GROUP_SIZE, HEAD_DIM,
                                                              PosEncodingMode::kNone, Variant,
                                                              Params>(
        split, max_grid, chunk_pages, work_items, gdy, batch, indptr_h, q_heads, page_size,
        /*enable_cuda_graph=*/false, nullptr);
  });
  return err;
}

// 16-byte vectors where every address and stride allows them (VEC = 8
// bf16), else one element at a time (VEC = 1).
template <int VEC>
__global__ void kv_append_kernel(const uint16_t* __restrict__ k, const uint16_t* __restrict__ v,
                                 const int64_t* __restrict__ slot_mapping,
                                 uint16_t* __restrict__ cache, int32_t kv_heads,
                                 int32_t head_dim, int32_t page_size, int64_t block_stride,
                                 int64_t k_stride_n, int64_t k_stride_h, int64_t v_stride_n,
                                 int64_t v_stride_h) {
  using Vec = typename std::conditional<VEC == 8, uint4, uint16_t>::type;
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // a padded token (vLLM's PAD_SLOT_ID): no write
  uint16_t* entry = cache + (slot / page_size) * block_stride +
                    (slot % page_size) * (int64_t)kv_heads * 2 * head_dim;
  const int32_t per_head = head_dim / VEC;
  for (int32_t i = threadIdx.x; i < kv_heads * per_head; i += blockDim.x) {
    const int32_t h = i / per_head, c = (i % per_head) * VEC;
    uint16_t* dst = entry + (int64_t)h * 2 * head_dim + c;
    *reinterpret_cast<Vec*>(dst) =
        *reinterpret_cast<const Vec*>(k + token * k_stride_n + h * k_stride_h + c);
    *reinterpret_cast<Vec*>(dst + head_dim) =
        *reinterpret_cast<const Vec*>(v + token * v_stride_n + h * v_stride_h + c);
  }
}

}  // namespace vllm_megakernel_baseline

using namespace vllm_megakernel_baseline;

#define EXPORT extern "C" __attribute__((visibility("default")))

// q [batch, q_heads, head_dim] (q_stride_n, q_stride_h in elements; the last
// dimension contiguous, rows 16-byte aligned), o [batch, q_heads, head_dim]
// contiguous; cache as above (block_stride in elements). The request's pages
// are indices[indptr[i]:indptr[i+1]], its last page holds last_page_len[i]
// tokens. Work item j runs request request_indices[j]'s tokens
// [t * chunk, (t + 1) * chunk) (t = kv_tile_indices[j], chunk =
// *kv_chunk_size tokens), the items of request i being o_indptr[i] ..
// o_indptr[i + 1] - 1 in order. tmp_v [work_items, q_heads, head_dim] bf16
// and tmp_s [work_items, q_heads] fp32: the partial outputs and their
// log-sum-exps; both null where no request is split (work_items == batch:
// the kernel writes o directly, no merge launched, as FlashInfer does for an
// unsplit plan). Group sizes 1, 2, 3, 4, 6, 8; head_dim 64 or 128.
EXPORT int flashinfer_paged_decode_split(
    void* q, void* cache, int32_t* indices, int32_t* indptr, int32_t* last_page_len, void* o,
    int32_t* request_indices, int32_t* kv_tile_indices, int32_t* o_indptr, int32_t* kv_chunk_size,
    void* tmp_v, float* tmp_s, int32_t batch, int32_t work_items, int32_t q_heads,
    int32_t kv_heads, int32_t head_dim, int32_t page_size, int64_t block_stride,
    int64_t q_stride_n, int64_t q_stride_h, float sm_scale, void* stream) {
  return decode(q, cache, indices, indptr, last_page_len, o, request_indices, kv_tile_indices,
                o_indptr, kv_chunk_size, tmp_v, tmp_s, batch, work_items, q_heads, kv_heads,
                head_dim, page_size, block_stride, q_stride_n, q_stride_h, sm_scale, stream);
}

// The same without split-KV: q contiguous; request_indices[i] = o_indptr[i]
// = i, kv_tile_indices[i] = 0 (kv_chunk_size is not read).
EXPORT int flashinfer_paged_decode(void* q, void* cache, int32_t* indices, int32_t* indptr,
                                   int32_t* last_page_len, void* o, int32_t* request_indices,
                                   int32_t* kv_tile_indices, int32_t* o_indptr,
                                   int32_t* kv_chunk_size, int32_t batch, int32_t q_heads,
                                   int32_t kv_heads, int32_t head_dim, int32_t page_size,
                                   int64_t block_stride, float sm_scale, void* stream) {
  return decode(q, cache, indices, indptr, last_page_len, o, request_indices, kv_tile_indices,
                o_indptr, kv_chunk_size, nullptr, nullptr, batch, batch, q_heads, kv_heads,
                head_dim, page_size, block_stride, (int64_t)q_heads * head_dim, head_dim,
                sm_scale, stream);
}

// FlashInfer's own decode planner (BatchDecodeWithPagedKVCacheWorkEstimation-
// Dispatched, as DecodePlan runs it) on a host indptr [batch + 1]: out[0]
// split (0/1), out[1] its grid limit (resident CTAs of the decode kernel,
// all SMs), out[2] the chunk in pages, out[3] the work items.
EXPORT int flashinfer_decode_work_estimation(int32_t* indptr_h, int32_t batch, int32_t q_heads,
                                             int32_t kv_heads, int32_t head_dim,
                                             int32_t page_size, int32_t* out) {
  if (!supported(q_heads, kv_heads, head_dim) || batch <= 0) return (int)cudaErrorInvalidValue;
  bool split = false;
  uint32_t max_grid = 0, chunk_pages = 0, work_items = 0;
  cudaError_t err;
  try {
    err = head_dim == 64 ? estimate<64>(split, max_grid, chunk_pages, work_items, indptr_h,
                                        batch, q_heads, kv_heads, page_size)
                         : estimate<128>(split, max_grid, chunk_pages, work_items, indptr_h,
                                         batch, q_heads, kv_heads, page_size);
  } catch (...) {
    return (int)cudaErrorInvalidValue;
  }
  out[0] = split;
  out[1] = (int32_t)max_grid;
  out[2] = (int32_t)chunk_pages;
  out[3] = (int32_t)work_items;
  return (int)err;
}

// k, v [tokens, kv_heads, head_dim] bf16 (strides in elements; the last
// dimension contiguous; views of the QKV output are fine), written at
// slot_mapping[t] (int64; slot s: block s / page_size, token s % page_size;
// negative: skipped) into the cache as above. One launch, one CTA a token.
EXPORT int kv_append(void* k, void* v, int64_t* slot_mapping, void* cache, int32_t tokens,
                     int32_t kv_heads, int32_t head_dim, int32_t page_size, int64_t block_stride,
                     int64_t k_stride_n, int64_t k_stride_h, int64_t v_stride_n,
                     int64_t v_stride_h, void* stream) {
  if (tokens < 0 || kv_heads <= 0 || head_dim <= 0 || page_size <= 0) {
    return (int)cudaErrorInvalidValue;
  }
  if (tokens == 0) return (int)cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const bool wide = head_dim % 8 == 0 && aligned(k) && aligned(v) && aligned(cache) &&
                    (k_stride_n | k_stride_h | v_stride_n | v_stride_h | block_stride) % 8 == 0;
  const int vec = wide ? 8 : 1;
  const int threads = std::min(1024, std::max(32, kv_heads * head_dim / vec));
  auto* kk = static_cast<const uint16_t*>(k);
  auto* vv = static_cast<const uint16_t*>(v);
  auto* cc = static_cast<uint16_t*>(cache);
  if (wide) {
    kv_append_kernel<8><<<tokens, threads, 0, s>>>(kk, vv, slot_mapping, cc, kv_heads, head_dim,
                                                   page_size, block_stride, k_stride_n,
                                                   k_stride_h, v_stride_n, v_stride_h);
  } else {
    kv_append_kernel<1><<<tokens, threads, 0, s>>>(kk, vv, slot_mapping, cc, kv_heads, head_dim,
                                                   page_size, block_stride, k_stride_n,
                                                   k_stride_h, v_stride_n, v_stride_h);
  }
  return (int)cudaGetLastError();
}
