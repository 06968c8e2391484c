// The extension module: each kernel file registers its functions.

#include <torch/extension.h>

void register_paged_attention(pybind11::module& m);  // paged_attention.cpp
void register_norm_rotary(pybind11::module& m);  // norm_rotary.cpp
void register_quant_linear(pybind11::module& m);  // quant_linear.cpp
void register_dense_linear(pybind11::module& m);  // dense_linear.cpp
void register_decoder(pybind11::module& m);  // decoder.cpp
void register_kv_cache(pybind11::module& m);  // kv_cache.cpp
void register_lora(pybind11::module& m);  // lora.cpp
void register_int8_act(pybind11::module& m);  // int8_act_linear.cpp
void register_mamba_state(pybind11::module& m);  // mamba_state.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_paged_attention(m);
  register_norm_rotary(m);
  register_quant_linear(m);
  register_dense_linear(m);
  register_decoder(m);
  register_kv_cache(m);
  register_lora(m);
  register_int8_act(m);
  register_mamba_state(m);
}
