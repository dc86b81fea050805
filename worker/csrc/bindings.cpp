// The extension's Python module: the functions of kernels.h, each wrapped so that a C++ error
// (TORCH_CHECK) reaches Python as a RuntimeError. The operators (rotary_qk, packed_linear,
// packed_linear_silu, packed_linear_argmax) are registered with torch.library where they are
// defined, under the namespace OP_NAMESPACE names.
#include "kernels.h"
#include "op_namespace.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("OP_NAMESPACE") = PAGEDSERVE_OPS_NAME;
  m.def("paged_attention", torch::wrap_pybind_function(paged_attention), "paged_attention");
  m.def("shared_prefix_attention", torch::wrap_pybind_function(shared_prefix_attention), "shared_prefix_attention");
  m.def("shared_prefix_attention_available", torch::wrap_pybind_function(shared_prefix_attention_available),
        "shared_prefix_attention_available");
  m.def("amx_prefill_attention", torch::wrap_pybind_function(amx_prefill_attention), "amx_prefill_attention");
  m.def("amx_attention_available", torch::wrap_pybind_function(amx_attention_available), "amx_attention_available");
  m.def("write_kv_cache", torch::wrap_pybind_function(write_kv_cache), "write_kv_cache");
  m.def("near_top_scan", torch::wrap_pybind_function(near_top_scan), "near_top_scan");
  m.def("sample_random_rows", torch::wrap_pybind_function(sample_random_rows), "sample_random_rows");
  m.def("token_logprobs_rows", torch::wrap_pybind_function(token_logprobs_rows), "token_logprobs_rows");
  m.def("bf16_linear_available", torch::wrap_pybind_function(bf16_linear_available), "bf16_linear_available");
  m.def("f32_linear_available", torch::wrap_pybind_function(f32_linear_available), "f32_linear_available");
  m.def("gguf_dequantize", torch::wrap_pybind_function(gguf_dequantize), "gguf_dequantize");
  m.def("int8_linear_available", torch::wrap_pybind_function(int8_linear_available), "int8_linear_available");
  m.def("int8_amx_available", torch::wrap_pybind_function(int8_amx_available), "int8_amx_available");
  m.def("set_int8_amx_rows", torch::wrap_pybind_function(set_int8_amx_rows), "set_int8_amx_rows");
  m.def("screened_argmax", torch::wrap_pybind_function(screened_argmax), "screened_argmax");
  m.def("screened_argmax_available", torch::wrap_pybind_function(screened_argmax_available),
        "screened_argmax_available");
  m.def("screened_bf16_argmax", torch::wrap_pybind_function(screened_bf16_argmax), "screened_bf16_argmax");
  m.def("bf16_screen_bounds", torch::wrap_pybind_function(bf16_screen_bounds), "bf16_screen_bounds");
  m.def("bf16_screen_available", torch::wrap_pybind_function(bf16_screen_available), "bf16_screen_available");
}
