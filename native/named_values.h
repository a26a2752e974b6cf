// PJRT_NamedValue arrays in both directions: owning copies of what a plugin
// reports (plugin, topology and device attributes), and views handed to a
// plugin (client and topology create options).
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "pjrt.h"

namespace pjrt_pool {

// One key-value pair: a plugin's attribute, or a create option.
struct Attribute {
  using Value = std::variant<std::string, int64_t, std::vector<int64_t>, float, bool>;
  std::string name;
  Value value;
};

// Owning copies of `count` NamedValues. A kind newer than the header is
// skipped rather than misread.
std::vector<Attribute> ReadNamedValues(const PJRT_NamedValue* values, size_t count);

// PJRT_NamedValues pointing into `options`, which must outlive them.
std::vector<PJRT_NamedValue> NamedValues(const std::vector<Attribute>& options);

// Points a create call's arguments (a client's, a topology's) at `values`, which must
// outlive the call.
template <typename CreateArgs>
void SetCreateOptions(CreateArgs& args, const std::vector<PJRT_NamedValue>& values) {
  args.create_options = values.data();
  args.num_options = values.size();
}

}  // namespace pjrt_pool
