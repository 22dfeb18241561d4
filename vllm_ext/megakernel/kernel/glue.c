// SPDX-License-Identifier: Apache-2.0
// C entry points of the AOT-built megakernel library: explicit, error-checked
// module load (the generated *_Kernel_Module_Load swallows errors) and a
// launch over raw device pointers. Needs only the CUDA driver at run time.
#include MEGAKERNEL_HEADER
#include <cuda_runtime.h>

#define API __attribute__((visibility("default")))

static megakernel_Kernel_Module_t g_module;
static int g_loaded = 0;

// 0 on success, else a cudaError_t.
API int megakernel_load(int device) {
  if (g_loaded) return 0;
  cudaError_t ret = cudaSuccess;
  cudaLibrary_t *library = &g_module.module;
  struct { cudaLibrary_t **library; cudaError_t *ret; } init = {&library, &ret};
  _mlir_megakernel_cuda_init((void **)&init);
  if (ret != cudaSuccess) return (int)ret;
  int32_t dev = device;
  struct { cudaLibrary_t **library; int32_t *device; cudaError_t *ret; } load = {
      &library, &dev, &ret};
  _mlir_megakernel_cuda_load_to_device((void **)&load);
  if (ret != cudaSuccess) return (int)ret;
  g_loaded = 1;
  return 0;
}

API int megakernel_unload(void) {
  if (!g_loaded) return 0;
  g_loaded = 0;
  return (int)cudaLibraryUnload(g_module.module);
}

// queue [num_sms, max_len, 8] int32; counters [num_counters + 1] int32, the
// last one the step number; ptrs [num_rows, NUM_SLOTS] int64 (shape.py).
API int megakernel_launch(void *queue, int32_t num_sms, int32_t max_len, void *lengths,
                          void *counters, int32_t num_counters, void *ptrs,
                          int32_t num_rows, int32_t block_table_stride,
                          int32_t kv_block_stride, float attn_scale, int32_t max_spins,
                          void *stream) {
  if (!g_loaded) return (int)cudaErrorInitializationError;
  megakernel_Tensor_queue_t tq = {queue, {num_sms, max_len}, {(int64_t)max_len * 8}};
  megakernel_Tensor_lengths_t tl = {lengths, {num_sms}};
  megakernel_Tensor_counters_t tc = {counters, {num_counters}};
  megakernel_Tensor_ptrs_t tp = {ptrs, {num_rows}};
  return cute_dsl_megakernel_wrapper(&g_module, &tq, &tl, &tc, &tp, block_table_stride,
                                     kv_block_stride, attn_scale, max_spins,
                                     (cudaStream_t)stream);
}

API const char *megakernel_error_string(int error) {
  return cudaGetErrorString((cudaError_t)error);
}
