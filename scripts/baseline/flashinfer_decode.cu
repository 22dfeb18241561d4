// SPDX-License-Identifier: Apache-2.0
// FlashInfer's paged decode attention (its header-only CUDA template, as
// vLLM 0.32.0's flashinfer-python 0.7.0.post1 ships it) behind a C entry
// point, for the GPU check's per-op baseline: the GPU machine has neither
// FlashInfer's Python package nor its dependencies, only torch + ctypes.
//
// Reads vLLM's FlashAttention cache layout in place: memory
// [block, token, kv_head, K|V], K at offset 0 and V at offset head_dim of
// each entry. One work item per request (no split-KV), bf16 in and out.
#include <flashinfer/attention/decode.cuh>
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

template <uint32_t HEAD_DIM>
int run(Params& p, cudaStream_t stream) {
  return (int)BatchDecodeWithPagedKVCacheDispatched<HEAD_DIM, PosEncodingMode::kNone, Variant,
                                                    Params>(p, nullptr, nullptr, false, stream);
}

}  // namespace vllm_megakernel_baseline

using namespace vllm_megakernel_baseline;

// q [batch, q_heads, head_dim], o likewise; cache as above; the request's
// pages are indices[indptr[i]:indptr[i+1]], its last page holds
// last_page_len[i] tokens; request_indices[i] = o_indptr[i] = i,
// kv_tile_indices[i] = 0, *kv_chunk_size >= the longest sequence.
// Returns a cudaError_t (0: success); group sizes 1, 2, 3, 4, 6, 8.
extern "C" __attribute__((visibility("default"))) int flashinfer_paged_decode(
    void* q, void* cache, int32_t* indices, int32_t* indptr, int32_t* last_page_len,
    void* o, int32_t* request_indices, int32_t* kv_tile_indices, int32_t* o_indptr,
    int32_t* kv_chunk_size, int32_t batch, int32_t q_heads, int32_t kv_heads,
    int32_t head_dim, int32_t page_size, int64_t block_stride, float sm_scale,
    void* stream) {
  auto* base = static_cast<DTypeKV*>(cache);
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
  p.padded_batch_size = batch;
  p.num_qo_heads = q_heads;
  p.q_stride_n = q_heads * head_dim;
  p.q_stride_h = head_dim;
  p.window_left = -1;
  p.enable_pdl = false;
  p.request_indices = request_indices;
  p.kv_tile_indices = kv_tile_indices;
  p.o_indptr = o_indptr;
  p.kv_chunk_size_ptr = kv_chunk_size;
  p.block_valid_mask = nullptr;
  p.partition_kv = false;
  auto s = static_cast<cudaStream_t>(stream);
  if (head_dim == 64) return run<64>(p, s);
  if (head_dim == 128) return run<128>(p, s);
  return (int)cudaErrorInvalidValue;
}
