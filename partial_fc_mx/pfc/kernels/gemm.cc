// Partial FC's three GEMMs by oneDNN 3 (the PyPI package onednn-cpu-gomp), for
// pfc/gemm.py: float32 in and out (dnnl_sgemm), or float32 in, rounded to bfloat16 here
// (to nearest, ties to even), accumulated and written in float32
// (dnnl_gemm_bf16bf16f32): the logits keep float32's 24 bits whatever the inputs'.
//
// MXNet 1.9.1 carries its own oneDNN 2.x, linked into libmxnet.so. The new one is
// opened here with RTLD_LOCAL | RTLD_DEEPBIND: its symbols resolve to its own first,
// and stay out of the process's global scope, so neither copy calls into the other
// (both are named dnnl_*). The library's path is the operators' attribute `library`.
//
//   pfc_gemm(a N x K, b n x K) -> a @ b^T (N x n), FullyConnected's forward;
//   pfc_gemm_backward(g N x n, x N x K, b n x K) -> (g @ b, g^T @ x), its backward,
//   which rounds g once for both.
#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>

#include "common.h"

namespace {

using Sgemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t,
                      const float*, int64_t, float, float*, int64_t);
using Bf16gemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const uint16_t*,
                         int64_t, const uint16_t*, int64_t, float, float*, int64_t);

struct OneDNN {
  Sgemm sgemm = nullptr;
  Bf16gemm bf16gemm = nullptr;
  std::string error;
};

// The library at `path`, opened once per process and path.
const OneDNN& onednn(const std::string& path) {
  static std::mutex lock;
  static std::map<std::string, OneDNN> opened;
  std::lock_guard<std::mutex> guard(lock);
  auto found = opened.find(path);
  if (found != opened.end()) return found->second;
  OneDNN& library = opened[path];
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (handle == nullptr) {
    const char* why = dlerror();
    library.error = "cannot open oneDNN at " + path + ": " + (why ? why : "no reason given");
    return library;
  }
  library.sgemm = reinterpret_cast<Sgemm>(dlsym(handle, "dnnl_sgemm"));
  library.bf16gemm = reinterpret_cast<Bf16gemm>(dlsym(handle, "dnnl_gemm_bf16bf16f32"));
  if (library.sgemm == nullptr || library.bf16gemm == nullptr) {
    library.error = path + " has no dnnl_sgemm or dnnl_gemm_bf16bf16f32: not oneDNN 3";
  }
  return library;
}

// bfloat16's bits of x rounded to nearest, ties to even; a NaN stays a NaN (its top
// bits, with the quiet bit set: rounding could carry a NaN's payload into infinity).
PFC_CLONES
void to_bfloat16(const float* x, uint16_t* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    out[i] = uint16_t(nan ? (bits >> 16) | 0x40u : rounded);
  }
}

// `tensor` rounded to bfloat16 into `scratch` (kept across calls: a fresh vector per
// step would page-fault through it every time), split over the operator's threads.
const uint16_t* rounded(const Attributes& attributes, MXTensor& tensor,
                        std::vector<uint16_t>* scratch) {
  const int64_t count = tensor.size();
  if (int64_t(scratch->size()) < count) scratch->resize(count);
  const float* x = tensor.data<float>();
  uint16_t* out = scratch->data();
  const int64_t chunk = 1 << 16;
  for_each_row(attributes, (count + chunk - 1) / chunk, [&](int64_t c) {
    const int64_t start = c * chunk;
    to_bfloat16(x + start, out + start, std::min(chunk, count - start));
  });
  return out;
}

struct Gemm {
  const OneDNN* library;
  bool bfloat16;
  int threads;
};

MXReturnValue read_gemm(const Attributes& attributes, const char* op, Gemm* gemm) {
  float bfloat16 = 0;
  if (read_numbers(attributes, op, {{"bfloat16", &bfloat16}}) != MX_SUCCESS) return MX_FAIL;
  const OneDNN& library = onednn(attributes.at("library"));
  if (!library.error.empty()) {
    MX_ERROR_MSG << op << ": " << library.error;
    return MX_FAIL;
  }
  *gemm = {&library, bfloat16 != 0, threads_of(attributes)};
  return MX_SUCCESS;
}

// c (m x n) = op(a) @ op(b), row-major, op transposing where the flag is 'T'; a and b
// are float32 tensors, rounded to bfloat16 first when the operator's inputs are.
MXReturnValue multiply(const Attributes& attributes, const char* op, const Gemm& gemm,
                       char transa, char transb, int64_t m, int64_t n, int64_t k,
                       MXTensor& a, const uint16_t* a16, MXTensor& b,
                       std::vector<uint16_t>* b_scratch, float* c) {
  const int64_t lda = transa == 'N' ? k : m, ldb = transb == 'N' ? n : k;
  omp_set_num_threads(gemm.threads);  // oneDNN's OpenMP threads: this engine thread's
  int status;
  if (gemm.bfloat16) {
    const uint16_t* b16 = rounded(attributes, b, b_scratch);
    status = gemm.library->bf16gemm(transa, transb, m, n, k, 1.f, a16, lda, b16, ldb, 0.f,
                                    c, n);
  } else {
    status = gemm.library->sgemm(transa, transb, m, n, k, 1.f, a.data<float>(), lda,
                                 b.data<float>(), ldb, 0.f, c, n);
  }
  if (status != 0) {  // dnnl_status_t: 2 invalid arguments, 3 unimplemented on this CPU
    MX_ERROR_MSG << op << ": oneDNN's " << (gemm.bfloat16 ? "dnnl_gemm_bf16bf16f32" : "dnnl_sgemm")
                 << " returned status " << status << " for " << m << " x " << k << " by "
                 << k << " x " << n;
    return MX_FAIL;
  }
  return MX_SUCCESS;
}

thread_local std::vector<uint16_t> scratch_a, scratch_b;

MXReturnValue gemm_arity(const Attributes& attributes, int* inputs, int* outputs) {
  return arity(attributes, "pfc_gemm", {"library", "bfloat16"}, 2, 1, inputs, outputs);
}

MXReturnValue gemm_shapes(const Attributes&, Shapes* in, Shapes* out) {
  const auto &a = (*in)[0], &b = (*in)[1];
  if (a.size() != 2 || b.size() != 2 || a[1] != b[1]) {
    MX_ERROR_MSG << "pfc_gemm needs an N x K and an n x K matrix";
    return MX_FAIL;
  }
  (*out)[0] = {a[0], b[0]};
  return MX_SUCCESS;
}

MXReturnValue gemm_forward(const Attributes& attributes, std::vector<MXTensor>* in,
                           std::vector<MXTensor>* out, const OpResource&) {
  Gemm gemm;
  if (read_gemm(attributes, "pfc_gemm", &gemm) != MX_SUCCESS) return MX_FAIL;
  MXTensor &a = (*in)[0], &b = (*in)[1];
  const uint16_t* a16 = gemm.bfloat16 ? rounded(attributes, a, &scratch_a) : nullptr;
  return multiply(attributes, "pfc_gemm", gemm, 'N', 'T', a.shape[0], b.shape[0], a.shape[1],
                  a, a16, b, &scratch_b, (*out)[0].data<float>());
}

MXReturnValue backward_arity(const Attributes& attributes, int* inputs, int* outputs) {
  return arity(attributes, "pfc_gemm_backward", {"library", "bfloat16"}, 3, 2, inputs,
               outputs);
}

MXReturnValue backward_shapes(const Attributes&, Shapes* in, Shapes* out) {
  const auto &g = (*in)[0], &x = (*in)[1], &b = (*in)[2];
  if (g.size() != 2 || x.size() != 2 || b.size() != 2 || g[0] != x[0] || g[1] != b[0] ||
      x[1] != b[1]) {
    MX_ERROR_MSG << "pfc_gemm_backward needs an N x n, an N x K and an n x K matrix";
    return MX_FAIL;
  }
  (*out)[0] = x;
  (*out)[1] = b;
  return MX_SUCCESS;
}

MXReturnValue backward_forward(const Attributes& attributes, std::vector<MXTensor>* in,
                               std::vector<MXTensor>* out, const OpResource&) {
  Gemm gemm;
  if (read_gemm(attributes, "pfc_gemm_backward", &gemm) != MX_SUCCESS) return MX_FAIL;
  MXTensor &g = (*in)[0], &x = (*in)[1], &b = (*in)[2];
  const int64_t rows = g.shape[0], cols = g.shape[1], width = x.shape[1];
  const uint16_t* g16 = gemm.bfloat16 ? rounded(attributes, g, &scratch_a) : nullptr;
  // grad x = g @ b (N x K), grad b = g^T @ x (n x K)
  if (multiply(attributes, "pfc_gemm_backward", gemm, 'N', 'N', rows, width, cols, g, g16, b,
               &scratch_b, (*out)[0].data<float>()) != MX_SUCCESS) {
    return MX_FAIL;
  }
  return multiply(attributes, "pfc_gemm_backward", gemm, 'T', 'N', cols, width, rows, g, g16,
                  x, &scratch_b, (*out)[1].data<float>());
}

}  // namespace

REGISTER_OP(pfc_gemm)
    .setParseAttrs(gemm_arity)
    .setInferType(all_float32)
    .setInferShape(gemm_shapes)
    .setForward(gemm_forward, "cpu");

REGISTER_OP(pfc_gemm_backward)
    .setParseAttrs(backward_arity)
    .setInferType(all_float32)
    .setInferShape(backward_shapes)
    .setForward(backward_forward, "cpu");
