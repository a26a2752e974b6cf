#include "named_values.h"

#include <utility>

namespace pjrt_pool {

std::vector<Attribute> ReadNamedValues(const PJRT_NamedValue* values, size_t count) {
  std::vector<Attribute> result;
  for (size_t i = 0; i < count; ++i) {
    const PJRT_NamedValue& nv = values[i];
    Attribute attribute;
    attribute.name.assign(nv.name, nv.name_size);
    switch (nv.type) {
      case PJRT_NamedValue_kString:
        attribute.value = std::string(nv.string_value, nv.value_size);
        break;
      case PJRT_NamedValue_kInt64:
        attribute.value = nv.int64_value;
        break;
      case PJRT_NamedValue_kInt64List:
        attribute.value = std::vector<int64_t>(nv.int64_array_value,
                                               nv.int64_array_value + nv.value_size);
        break;
      case PJRT_NamedValue_kFloat:
        attribute.value = nv.float_value;
        break;
      case PJRT_NamedValue_kBool:
        attribute.value = nv.bool_value;
        break;
      default:
        continue;
    }
    result.push_back(std::move(attribute));
  }
  return result;
}

std::vector<PJRT_NamedValue> NamedValues(const std::vector<Attribute>& options) {
  std::vector<PJRT_NamedValue> values;
  for (const Attribute& option : options) {
    auto value = MakeArgs<PJRT_NamedValue>(PJRT_NamedValue_STRUCT_SIZE);
    value.name = option.name.data();
    value.name_size = option.name.size();
    value.value_size = 1;
    if (auto* s = std::get_if<std::string>(&option.value)) {
      value.type = PJRT_NamedValue_kString;
      value.string_value = s->data();
      value.value_size = s->size();
    } else if (auto* i = std::get_if<int64_t>(&option.value)) {
      value.type = PJRT_NamedValue_kInt64;
      value.int64_value = *i;
    } else if (auto* list = std::get_if<std::vector<int64_t>>(&option.value)) {
      value.type = PJRT_NamedValue_kInt64List;
      value.int64_array_value = list->data();
      value.value_size = list->size();
    } else if (auto* f = std::get_if<float>(&option.value)) {
      value.type = PJRT_NamedValue_kFloat;
      value.float_value = *f;
    } else {
      value.type = PJRT_NamedValue_kBool;
      value.bool_value = std::get<bool>(option.value);
    }
    values.push_back(value);
  }
  return values;
}

}  // namespace pjrt_pool
