// What every operator of the library needs (rows.cc, prelu.cc, layer_norm.cc): the
// vector widths it is built for, reading its attributes, its threads, and the checks
// MXNet asks for. Each source includes it inside its own anonymous namespace: the
// library exports only the operators that REGISTER_OP names.
#ifndef PARTIAL_FC_MX_KERNELS_COMMON_H_
#define PARTIAL_FC_MX_KERNELS_COMMON_H_

#include <omp.h>

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mxnet/lib_api.h"

using namespace mxnet::ext;

using Attributes = std::unordered_map<std::string, std::string>;
using Shapes = std::vector<std::vector<unsigned int>>;

// Vectorized code for the CPU it runs on, chosen when the library loads: the library
// is built once per machine type but may sit on a home folder that several hosts share.
// The code is plain multiplies and adds (no std::fma, no rint): every clone vectorizes
// it, and the compiler fuses them where the clone has FMA (x86-64-v3 is AVX2 with FMA);
// std::fma in a clone without FMA is a call per element (20x slower, found in review).
// Defined empty with one -march, a build has that code alone (how the tests run each).
#ifndef PFC_CLONES
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define PFC_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else  // "arch=" clones came with GCC 12 (Ubuntu 22.04 has 11): AVX2 without FMA before
#define PFC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif

namespace {

// An attribute's number as the Python side wrote it, or false. strtof rather than
// std::stof, which throws (an exception must not cross the library's C interface); the
// decimal point is the C locale's, where Python leaves LC_NUMERIC.
bool read_number(const Attributes& attributes, const char* name, float* value) {
  auto found = attributes.find(name);
  if (found == attributes.end() || found->second.empty()) return false;
  char* end = nullptr;
  *value = std::strtof(found->second.c_str(), &end);
  return *end == '\0';
}

// The numbers an operator needs, each named in the error when it cannot be read.
MXReturnValue read_numbers(const Attributes& attributes, const char* op,
                           std::initializer_list<std::pair<const char*, float*>> wanted) {
  for (const auto& [name, value] : wanted) {
    if (!read_number(attributes, name, value)) {
      MX_ERROR_MSG << op << ": cannot read the number " << name;
      return MX_FAIL;
    }
  }
  return MX_SUCCESS;
}

int threads_of(const Attributes& attributes) {
  float threads = 1;
  if (!read_number(attributes, "threads", &threads) || !(threads >= 1)) return 1;
  return threads < 4096 ? int(threads) : 4096;  // a float past INT_MAX has no int
}

// row(i) for i in [0, rows), the rows split over the operator's threads.
template <typename Row>
void for_each_row(const Attributes& attributes, int64_t rows, Row row) {
#pragma omp parallel for num_threads(threads_of(attributes)) schedule(static)
  for (int64_t i = 0; i < rows; ++i) row(i);
}

// An operator's counts of inputs and outputs, once the attributes it needs are there.
MXReturnValue arity(const Attributes& attributes, const char* op,
                    std::initializer_list<const char*> needed, int inputs, int outputs,
                    int* num_inputs, int* num_outputs) {
  for (const char* name : needed) {
    if (attributes.find(name) == attributes.end()) {
      MX_ERROR_MSG << op << " needs the attribute " << name;
      return MX_FAIL;
    }
  }
  *num_inputs = inputs;
  *num_outputs = outputs;
  return MX_SUCCESS;
}

MXReturnValue all_float32(const Attributes&, std::vector<int>* in_types,
                          std::vector<int>* out_types) {
  for (int type : *in_types) {
    if (type != kFloat32) {
      MX_ERROR_MSG << "partial_fc_mx kernels take float32 arrays only";
      return MX_FAIL;
    }
  }
  for (int& type : *out_types) type = kFloat32;
  return MX_SUCCESS;
}

}  // namespace

#endif  // PARTIAL_FC_MX_KERNELS_COMMON_H_
