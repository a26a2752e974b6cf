// The Python binding: the only place C++ exceptions become Python exceptions
// (PjrtException -> PjrtError, FfiVersionException -> HandlerVersionError,
// PluginLoadException -> PluginLoadError, SocketException -> a ConnectionError
// (its errno's own, else SocketError): the classes worker.errors defines;
// std::system_error -> OSError, and pybind11's own std::invalid_argument ->
// ValueError for bad inputs) and the only place the GIL is released (around compile,
// deserialize and execute, which can run for seconds, and the hot loop).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <system_error>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>
#include <variant>

#include "client.h"
#include "copies.h"
#include "device_values.h"
#include "hot_loop.h"
#include "segments.h"
#include "plugin.h"
#include "status.h"
#include "topology.h"

namespace py = pybind11;
using namespace pjrt_pool;

namespace {

// Raised for every failed PJRT call, with `code` (int) and `code_name` set.
PyObject* g_pjrt_error = nullptr;
// Raised when an FFI handler's XLA FFI version is one the plugin cannot take,
// with `handler_version` and `plugin_version` set as (major, minor).
PyObject* g_handler_version_error = nullptr;
// Raised when a plugin library cannot be loaded or used.
PyObject* g_plugin_load_error = nullptr;
// Raised when the hot loop's socket fails with an errno that has no
// ConnectionError of its own (EPROTO, EBADF, ...).
PyObject* g_socket_error = nullptr;

py::object VersionTuple(const std::optional<FfiVersion>& version) {
  if (!version) return py::none();
  return py::make_tuple(version->major, version->minor);
}

// Sets the Python exception of `type` for `e`, with code and code_name.
py::object RaisePjrtError(PyObject* type, const PjrtException& e) {
  py::object error =
      py::reinterpret_steal<py::object>(PyObject_CallFunction(type, "s", e.what()));
  if (!error) return error;  // the call set its own exception
  error.attr("code") = e.code();
  error.attr("code_name") = ErrorCodeName(e.code());
  return error;
}

// Sets a ConnectionError for a socket's failure: the errno's own subclass
// (ConnectionResetError, BrokenPipeError, ...) or else SocketError. Every
// socket failure is one, and nothing else the hot loop raises is: its caller
// ends at a ConnectionError and answers any other error as a request's.
void RaiseSocketError(const SocketException& e) {
  const std::string message = std::strerror(e.error()) + std::string(" (") + e.what() + ")";
  py::object error = py::reinterpret_steal<py::object>(
      PyObject_CallFunction(PyExc_OSError, "is", e.error(), message.c_str()));
  if (error && !PyObject_IsInstance(error.ptr(), PyExc_ConnectionError)) {
    error = py::reinterpret_steal<py::object>(
        PyObject_CallFunction(g_socket_error, "is", e.error(), message.c_str()));
  }
  if (!error) return;  // the call set its own exception
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
}

std::string_view View(const py::buffer_info& info) {
  return {static_cast<const char*>(info.ptr), static_cast<size_t>(info.size * info.itemsize)};
}

bool IsCContiguous(const py::buffer_info& info) {
  py::ssize_t expected = info.itemsize;
  for (py::ssize_t axis = info.ndim - 1; axis >= 0; --axis) {
    if (info.shape[axis] > 1 && info.strides[axis] != expected) return false;
    expected *= info.shape[axis];
  }
  return true;
}

// An FFI handler given as a PyCapsule (jaxlib's registrations() style) or as
// an integer address.
void* HandlerPointer(const py::object& handler) {
  if (PyCapsule_CheckExact(handler.ptr())) {
    void* pointer = PyCapsule_GetPointer(handler.ptr(), PyCapsule_GetName(handler.ptr()));
    if (pointer == nullptr) throw py::error_already_set();
    return pointer;
  }
  if (py::isinstance<py::int_>(handler)) {
    auto address = handler.cast<uintptr_t>();
    if (address == 0) throw py::value_error("the FFI handler address is 0");
    return reinterpret_cast<void*>(address);
  }
  throw py::type_error("an FFI handler must be a PyCapsule or an integer address, not " +
                       std::string(py::str(py::type::handle_of(handler).attr("__name__"))));
}

py::object AttributeValue(const Attribute& attribute) {
  return std::visit([](const auto& value) -> py::object {
    using T = std::decay_t<decltype(value)>;
    if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
      return py::tuple(py::cast(value));
    } else {
      return py::cast(value);
    }
  }, attribute.value);
}

Attribute::Value OptionValue(const py::handle& value) {
  // bool first: Python's bool is an int.
  if (py::isinstance<py::bool_>(value)) return value.cast<bool>();
  if (py::isinstance<py::int_>(value)) return value.cast<int64_t>();
  if (py::isinstance<py::float_>(value)) return value.cast<float>();
  if (py::isinstance<py::str>(value)) return value.cast<std::string>();
  if (py::isinstance<py::sequence>(value)) return value.cast<std::vector<int64_t>>();
  throw py::type_error("a client option must be str, int, float, bool or a list of ints");
}

py::dict AttributeDict(const std::vector<Attribute>& attributes) {
  py::dict result;
  for (const Attribute& attribute : attributes) {
    result[py::str(attribute.name)] = AttributeValue(attribute);
  }
  return result;
}

std::vector<Attribute> Options(const py::dict& options) {
  std::vector<Attribute> values;
  for (const auto& [name, value] : options) {
    values.push_back(Attribute{name.cast<std::string>(), OptionValue(value)});
  }
  return values;
}

py::list OutputTypeList(const std::vector<OutputType>& types) {
  py::list result;
  for (const OutputType& output : types) {
    result.append(py::make_tuple(output.element_type, py::tuple(py::cast(output.dims))));
  }
  return result;
}

py::object OptionalBytes(const std::optional<std::string>& bytes) {
  if (!bytes) return py::none();
  return py::bytes(*bytes);
}

// Host inputs viewing Python buffers; `infos` holds the buffers' views, and so
// the memory, for as long as the inputs are used (the GIL may be released).
std::vector<HostInput> HostInputs(const py::list& inputs, const std::vector<int>& element_types,
                                  std::vector<py::buffer_info>& infos) {
  if (element_types.size() != inputs.size()) {
    throw py::value_error("one element type is needed per input");
  }
  std::vector<HostInput> host_inputs;
  infos.reserve(inputs.size());
  host_inputs.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    infos.push_back(inputs[i].cast<py::buffer>().request());
    const py::buffer_info& info = infos.back();
    if (!IsCContiguous(info)) throw py::value_error("input buffers must be C-contiguous");
    host_inputs.push_back(HostInput{info.ptr, static_cast<size_t>(info.size * info.itemsize),
                                    element_types[i],
                                    std::vector<int64_t>(info.shape.begin(), info.shape.end())});
  }
  return host_inputs;
}

// Host memory viewing a writable Python buffer; `infos` holds the view.
HostOutput HostOutputOf(const py::handle& item, std::vector<py::buffer_info>& infos) {
  infos.push_back(item.cast<py::buffer>().request(/*writable=*/true));
  const py::buffer_info& info = infos.back();
  if (!IsCContiguous(info)) throw py::value_error("output buffers must be C-contiguous");
  return HostOutput{info.ptr, static_cast<size_t>(info.size * info.itemsize)};
}

// Runs `execute` on the Python buffers as HostInputs and HostOutputs. The
// buffer_info objects hold the Python buffers' views for the whole call, so
// the memory stays valid while the GIL is released.
template <typename Run>
void WithHostArrays(const py::list& inputs, const std::vector<int>& element_types,
                    const py::list& outputs, Run&& execute) {
  std::vector<py::buffer_info> input_infos;
  std::vector<HostInput> host_inputs = HostInputs(inputs, element_types, input_infos);
  std::vector<py::buffer_info> output_infos;
  std::vector<HostOutput> host_outputs;
  output_infos.reserve(outputs.size());
  host_outputs.reserve(outputs.size());
  for (const py::handle& item : outputs) host_outputs.push_back(HostOutputOf(item, output_infos));
  py::gil_scoped_release release;
  execute(host_inputs, host_outputs);
}

void Execute(const Executable& executable, const py::list& inputs,
             const std::vector<int>& element_types, const py::list& outputs, bool zero_copy) {
  WithHostArrays(inputs, element_types, outputs,
                 [&](const std::vector<HostInput>& in, const std::vector<HostOutput>& out) {
                   executable.Execute(in, out, zero_copy);
                 });
}

void ExecuteSharded(const Executable& executable, const py::list& inputs,
                    const std::vector<int>& element_types, const py::list& outputs,
                    bool zero_copy) {
  WithHostArrays(inputs, element_types, outputs,
                 [&](const std::vector<HostInput>& in, const std::vector<HostOutput>& out) {
                   executable.ExecuteSharded(in, out, zero_copy);
                 });
}

// An array's shards as Python gives them: (PJRT_Buffer_Type, global dims,
// [(start, dims) per device, in device-assignment order]).
using PyArrayShards = std::tuple<int, std::vector<int64_t>,
                                 std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>>;

std::vector<ArrayShards> ShardsOf(const std::vector<PyArrayShards>& arrays) {
  std::vector<ArrayShards> result;
  for (const auto& [element_type, dims, blocks] : arrays) {
    ArrayShards array;
    array.element_type = element_type;
    array.dims = dims;
    for (const auto& [start, block] : blocks) array.shards.push_back(Shard{start, block});
    result.push_back(std::move(array));
  }
  return result;
}

std::vector<std::shared_ptr<DeviceValue>> ExecuteToValues(const Executable& executable,
                                                          const py::list& inputs,
                                                          const std::vector<int>& element_types,
                                                          bool zero_copy) {
  std::vector<py::buffer_info> infos;
  std::vector<HostInput> host_inputs = HostInputs(inputs, element_types, infos);
  std::vector<Argument> arguments;
  arguments.reserve(host_inputs.size());
  for (HostInput& input : host_inputs) arguments.push_back(Argument{std::move(input), nullptr});
  py::gil_scoped_release release;
  return RunToValues(executable, arguments, zero_copy);
}

// A placed run's sources or destinations from Python's (kind, id, offset) tuples.
std::vector<Where> Wheres(const std::vector<std::tuple<int64_t, int64_t, int64_t>>& items) {
  std::vector<Where> result;
  result.reserve(items.size());
  for (const auto& [kind, id, offset] : items) {
    if (kind != Where::kPlace && kind != Where::kValue) {
      throw py::value_error("a place's kind is 0 (shared memory) or 1 (a value), not " +
                            std::to_string(kind));
    }
    result.push_back(Where{kind, id, offset});
  }
  return result;
}

// The hot loop and the exported buffer of its arena, which stays mapped (and
// its mapping unclosable) for as long as the loop can touch it.
struct ArenaHotLoop {
  py::buffer_info arena;
  HotLoop loop;
};

std::unique_ptr<ArenaHotLoop> MakeHotLoop(int fd, const py::buffer& arena, size_t arena_size,
                                          double spin_seconds) {
  py::buffer_info info = arena.request(/*writable=*/true);
  const size_t length = static_cast<size_t>(info.size * info.itemsize);
  if (length < arena_size || length - arena_size < sizeof(int64_t)) {
    throw py::value_error("the arena's buffer has " + std::to_string(length) +
                          " bytes: it needs arena_size bytes and the control bytes after them");
  }
  auto* data = static_cast<uint8_t*>(info.ptr);
  return std::unique_ptr<ArenaHotLoop>(
      new ArenaHotLoop{std::move(info), HotLoop(fd, data, arena_size, spin_seconds)});
}

py::tuple Serve(ArenaHotLoop& self) {
  while (true) {
    Unanswered frame;
    {
      py::gil_scoped_release release;
      frame = self.loop.Serve();
    }
    if (!frame.interrupted) {
      return py::make_tuple(py::bytes(frame.first), py::cast(frame.fds), frame.truncated);
    }
    // A signal woke the loop before any byte came: its Python handler runs
    // now, and what it raises (KeyboardInterrupt) ends the loop.
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

// What an executable compiled here says of itself, loaded (Executable) or not
// (UnloadedExecutable): its outputs, its serialized form (made with the GIL released)
// and its fingerprint.
template <typename Compiled>
void BindCompiled(py::class_<Compiled, std::shared_ptr<Compiled>>& compiled) {
  compiled.def_property_readonly("num_outputs", &Compiled::num_outputs)
      .def_property_readonly("output_types", [](const Compiled& executable) {
        return OutputTypeList(executable.output_types());
      }, "(PJRT_Buffer_Type, dims) of each output.")
      .def("serialize", [](const Compiled& executable) {
        std::string bytes;
        {
          py::gil_scoped_release release;
          bytes = executable.Serialize();
        }
        return py::bytes(bytes);
      }, "The plugin's serialized form, exactly as PJRT_Executable_Serialize gives it.")
      .def("fingerprint", [](const Compiled& executable) {
        return OptionalBytes(executable.Fingerprint());
      }, "The plugin's fingerprint of the executable, or None where it keeps none.");
}

}  // namespace

PYBIND11_MODULE(_pjrt, m) {
  m.doc() = "PJRT plugins, clients and executables for pjrt-pool's worker side.";

  // The classes are worker.errors' (there, every error pjrt-pool raises derives from
  // PjrtPoolError); that module imports nothing of this one. The references are kept
  // for the life of the process, as the module's own attributes are.
  py::module_ errors = py::module_::import("worker.errors");
  const auto error_class = [&errors](const char* name) {
    return py::object(errors.attr(name)).release().ptr();
  };
  g_pjrt_error = error_class("PjrtError");
  g_plugin_load_error = error_class("PluginLoadError");
  g_socket_error = error_class("SocketError");
  g_handler_version_error = error_class("HandlerVersionError");
  m.attr("PjrtError") = py::handle(g_pjrt_error);
  m.attr("HandlerVersionError") = py::handle(g_handler_version_error);
  m.attr("PluginLoadError") = py::handle(g_plugin_load_error);
  m.attr("SocketError") = py::handle(g_socket_error);
  m.attr("API_MAJOR") = PJRT_API_MAJOR;
  m.attr("API_MINOR") = PJRT_API_MINOR;

  py::register_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const FfiVersionException& e) {
      py::object error = RaisePjrtError(g_handler_version_error, e);
      if (!error) return;
      error.attr("handler_version") = VersionTuple(e.handler());
      error.attr("plugin_version") = VersionTuple(e.plugin());
      PyErr_SetObject(g_handler_version_error, error.ptr());
    } catch (const PjrtException& e) {
      py::object error = RaisePjrtError(g_pjrt_error, e);
      if (!error) return;
      PyErr_SetObject(g_pjrt_error, error.ptr());
    } catch (const PluginLoadException& e) {
      PyErr_SetString(g_plugin_load_error, e.what());
    } catch (const SocketException& e) {
      RaiseSocketError(e);
    } catch (const SlotMissingException& e) {
      PyErr_SetString(PyExc_LookupError, e.what());
    } catch (const std::system_error& e) {
      PyErr_SetObject(PyExc_OSError,
                      py::make_tuple(e.code().value(), std::string(e.what())).ptr());
    }
  });

  m.def(
      "stream_copy",
      [](const py::buffer& destination, const py::buffer& source) {
        py::buffer_info to = destination.request(/*writable=*/true);
        py::buffer_info from = source.request();
        const size_t size = static_cast<size_t>(to.size * to.itemsize);
        if (!IsCContiguous(to) || !IsCContiguous(from) ||
            size != static_cast<size_t>(from.size * from.itemsize)) {
          throw py::value_error(
              "stream_copy takes a C-contiguous writable buffer and a C-contiguous source "
              "of as many bytes (" + std::to_string(size) + " and " +
              std::to_string(from.size * from.itemsize) + " given)");
        }
        py::gil_scoped_release release;
        StreamCopy(to.ptr, from.ptr, size);
      },
      py::arg("destination"), py::arg("source"),
      "Copies source's bytes into destination (both C-contiguous, as many bytes) without "
      "the GIL, writing around the CPU's caches where it can: for copies larger than "
      "the caches (the parent's copy of a large input into shared memory).");

  py::class_<Plugin, std::shared_ptr<Plugin>>(m, "Plugin",
                                              "A loaded PJRT plugin library.")
      .def_static("load", &Plugin::Load, py::arg("path"),
                  py::call_guard<py::gil_scoped_release>(),
                  "Loads and initializes the plugin at path (once per process).")
      .def_property_readonly("path", &Plugin::path)
      .def_property_readonly("api_version", [](const Plugin& plugin) {
        return py::make_tuple(plugin.api_major(), plugin.api_minor());
      })
      .def_property_readonly("has_ffi_registration", &Plugin::has_ffi_registration)
      .def("attributes", [](const Plugin& plugin) { return AttributeDict(plugin.attributes()); },
           "The plugin's PJRT_Plugin_Attributes as a dict.")
      .def("ffi_api_version",
           [](const Plugin& plugin, const std::string& platform) {
             return VersionTuple(plugin.FfiApiVersion(platform));
           },
           py::arg("platform"),
           "The (major, minor) XLA FFI API version of the plugin's XLA for an FFI platform "
           "(\"Host\", \"CUDA\"), or None when the plugin does not show it.")
      .def("handler_ffi_version",
           [](const Plugin& plugin, const py::object& handler, const std::string& platform) {
             return VersionTuple(plugin.HandlerFfiVersion(HandlerPointer(handler), platform));
           },
           py::arg("handler"), py::arg("platform"),
           "The (major, minor) XLA FFI version an FFI handler reports to this plugin's XLA, "
           "or None when the plugin's own version is unknown.")
      .def("register_ffi_handler",
           [](const Plugin& plugin, const std::string& target, const py::object& handler,
              const std::string& platform, uint32_t traits) {
             FfiRegistration registration =
                 plugin.RegisterFfiHandler(target, HandlerPointer(handler), platform, traits);
             py::dict result;
             result["plugin_version"] = VersionTuple(registration.plugin);
             result["handler_version"] = VersionTuple(registration.handler);
             result["adapted"] = registration.adapted;
             return result;
           },
           py::arg("target"), py::arg("handler"), py::arg("platform"), py::arg("traits") = 0,
           "Registers a typed XLA FFI handler (PyCapsule or address) for a custom-call target. "
           "Returns the XLA FFI versions of plugin and handler and whether the handler runs "
           "through an adapter; raises HandlerVersionError for a handler the plugin's XLA "
           "cannot take.");

  py::class_<Client, std::shared_ptr<Client>>(m, "Client", "A PJRT client on one plugin.")
      .def(py::init([](std::shared_ptr<Plugin> plugin, const py::dict& options) {
             std::vector<Attribute> values = Options(options);
             py::gil_scoped_release release;
             return Client::Create(std::move(plugin), values);
           }),
           py::arg("plugin"), py::arg("options") = py::dict(),
           "Creates a client; options are plugin-specific create options "
           "(str, int, float, bool or a list of ints).")
      .def_property_readonly("platform_name", &Client::platform_name)
      .def_property_readonly("platform_version", &Client::platform_version)
      .def_property_readonly("device_kind", &Client::device_kind)
      .def_property_readonly("num_devices", &Client::num_devices)
      .def_property_readonly("device_ids", &Client::device_ids,
                             "The ids of the addressable devices, in the plugin's order.")
      .def("compile",
           [](Client& client, const py::buffer& code, const py::buffer& options) {
             py::buffer_info code_info = code.request();
             py::buffer_info options_info = options.request();
             py::gil_scoped_release release;
             return client.Compile(View(code_info), View(options_info));
           },
           py::arg("code"), py::arg("compile_options"),
           "Compiles MLIR bytecode with a serialized CompileOptionsProto.")
      .def("deserialize",
           [](Client& client, const py::buffer& serialized) {
             py::buffer_info info = serialized.request();
             py::gil_scoped_release release;
             return client.Deserialize(View(info));
           },
           py::arg("serialized"), "Loads an executable serialized by the same plugin.")
      .def("topology", [](std::shared_ptr<Client> client) { return Topology::OfClient(client); },
           "The topology of the client's devices.");

  py::class_<UnloadedExecutable, std::shared_ptr<UnloadedExecutable>> unloaded(
      m, "UnloadedExecutable",
      "An executable compiled for a topology without a device: it serializes, and a client "
      "on matching devices loads the bytes.");
  BindCompiled(unloaded);

  py::class_<Topology, std::shared_ptr<Topology>>(
      m, "Topology", "The devices a program is compiled for, with or without those devices.")
      .def_static("create",
                  [](std::shared_ptr<Plugin> plugin, const std::string& name,
                     const py::dict& options) {
                    std::vector<Attribute> values = Options(options);
                    py::gil_scoped_release release;
                    return Topology::Create(std::move(plugin), name, values);
                  },
                  py::arg("plugin"), py::arg("name"), py::arg("options") = py::dict(),
                  "Creates the named topology (libtpu: \"v5e:2x2\") with plugin-specific "
                  "create options, opening no device.")
      .def_static("deserialize",
                  [](std::shared_ptr<Plugin> plugin, const py::buffer& serialized) {
                    py::buffer_info info = serialized.request();
                    std::string bytes(View(info));
                    py::gil_scoped_release release;
                    return Topology::Deserialize(std::move(plugin), bytes);
                  },
                  py::arg("plugin"), py::arg("serialized"),
                  "Rebuilds a topology from Topology.serialize's bytes, same plugin build.")
      .def_property_readonly("platform_name", &Topology::platform_name)
      .def_property_readonly("platform_version", &Topology::platform_version)
      .def_property_readonly("devices", [](const Topology& topology) {
        py::list result;
        for (const DeviceDescription& device : topology.devices()) {
          py::dict entry;
          entry["id"] = device.id;
          entry["process_index"] = device.process_index;
          entry["kind"] = device.kind;
          entry["attributes"] = AttributeDict(device.attributes);
          result.append(entry);
        }
        return result;
      }, "Each device as {id, process_index, kind, attributes}.")
      .def("attributes", [](const Topology& topology) {
        return AttributeDict(topology.attributes());
      }, "The topology's platform-specific attributes as a dict.")
      .def("serialize", [](const Topology& topology) { return py::bytes(topology.Serialize()); },
           "The plugin's serialized form of the topology.")
      .def("compile",
           [](const Topology& topology, const py::buffer& code, const py::buffer& options) {
             py::buffer_info code_info = code.request();
             py::buffer_info options_info = options.request();
             py::gil_scoped_release release;
             return topology.Compile(View(code_info), View(options_info));
           },
           py::arg("code"), py::arg("compile_options"),
           "Compiles MLIR bytecode with a serialized CompileOptionsProto for this topology, "
           "with no client.");

  py::class_<DeviceValue, std::shared_ptr<DeviceValue>>(
      m, "DeviceValue", py::buffer_protocol(),
      "A program's value held by the plugin (an output, or a value a worker keeps). Its "
      "buffer is the host memory it lies in, where it lies in host memory (CPU plugins).")
      .def_buffer([](DeviceValue& value) -> py::buffer_info {
        const void* data = value.HostView();
        if (data == nullptr) {
          throw py::buffer_error("the value lies on a device, not in host memory: to_host copies it");
        }
        // Writable: the buffer is the value's alone (an output PJRT allocated for it).
        return py::buffer_info(const_cast<void*>(data), 1, py::format_descriptor<uint8_t>::format(),
                               1, {static_cast<py::ssize_t>(value.size())}, {1}, false);
      })
      .def_property_readonly("element_type", &DeviceValue::element_type)
      .def_property_readonly("dims", [](const DeviceValue& value) {
        return py::tuple(py::cast(value.dims()));
      })
      .def_property_readonly("nbytes", &DeviceValue::size)
      .def_property_readonly("in_host_memory", [](const DeviceValue& value) {
        return value.HostView() != nullptr;
      }, "Whether the value lies in host memory, which its buffer exposes without a copy.")
      .def("to_host",
           [](const DeviceValue& value, const py::buffer& out) {
             std::vector<py::buffer_info> infos;
             HostOutput output = HostOutputOf(out, infos);
             py::gil_scoped_release release;
             value.ToHost(output);
           },
           py::arg("out"), "Copies the value, row-major, into a writable buffer of its size.");

  py::class_<Mapping, std::shared_ptr<Mapping>>(
      m, "Mapping", py::buffer_protocol(), "A shared-memory segment a worker keeps mapped.")
      .def_buffer([](Mapping& mapping) -> py::buffer_info {
        return py::buffer_info(mapping.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(mapping.size())}, {1}, false);
      });

  py::class_<Executable, std::shared_ptr<Executable>> loaded(m, "Executable",
                                                             "A loaded PJRT executable.");
  BindCompiled(loaded);
  loaded
      .def_property_readonly("device_ids", &Executable::device_ids,
                             "The ids of the devices it runs on, in PJRT's order.")
      .def_property_readonly("sharded", &Executable::sharded,
                             "Whether set_shards gave it a plan of several devices.")
      .def("set_shards",
           [](Executable& executable, const std::vector<int>& device_ids,
              const std::vector<PyArrayShards>& inputs,
              const std::vector<PyArrayShards>& outputs) {
             executable.SetShards(device_ids, ShardPlan{ShardsOf(inputs), ShardsOf(outputs)});
           },
           py::arg("device_ids"), py::arg("inputs"), py::arg("outputs"),
           "Says how a program over several devices splits its global arrays: device_ids in "
           "device-assignment order, and per input and output (PJRT_Buffer_Type, global dims, "
           "[(start, dims) per device in that order]). Raises ValueError for a plan that does "
           "not fit the executable.")
      .def("execute_sharded", &ExecuteSharded, py::arg("inputs"), py::arg("element_types"),
           py::arg("outputs"), py::arg("zero_copy"),
           "Runs over every device on C-contiguous global input buffers and writes each global "
           "output into the matching writable buffer (set_shards first).")
      .def("execute", &Execute, py::arg("inputs"), py::arg("element_types"),
           py::arg("outputs"), py::arg("zero_copy"),
           "Runs with C-contiguous input buffers of the given PJRT element types and "
           "writes each output into the matching writable buffer. Raises ValueError, "
           "before the plugin sees anything, for an unknown element type or a buffer "
           "whose size is not its dims times the element size.")
      .def("execute_values", &ExecuteToValues, py::arg("inputs"), py::arg("element_types"),
           py::arg("zero_copy"),
           "Runs as execute does, and returns the outputs as DeviceValues, which stay where "
           "the plugin put them (on a CPU, host memory numpy can view without a copy).");

  py::class_<ArenaHotLoop>(m, "HotLoop",
                           "A worker's loop that answers HotRuns of registered slots without "
                           "Python (worker.serve.server).")
      .def(py::init(&MakeHotLoop), py::arg("fd"), py::arg("arena"), py::arg("arena_size"),
           py::arg("spin_seconds"),
           "Serves the socket fd (kept open by the caller) on the arena: a writable buffer of "
           "arena_size data bytes, then the control bytes.")
      .def("set_slot",
           [](ArenaHotLoop& self, int64_t slot, std::shared_ptr<Executable> executable,
              const std::vector<std::tuple<size_t, size_t, int, std::vector<int64_t>>>& inputs,
              const std::vector<std::pair<size_t, size_t>>& outputs) {
             std::vector<SlotInput> slot_inputs;
             for (const auto& [offset, size, element_type, dims] : inputs) {
               slot_inputs.push_back(SlotInput{offset, size, element_type, dims});
             }
             std::vector<SlotOutput> slot_outputs;
             for (const auto& [offset, size] : outputs) {
               slot_outputs.push_back(SlotOutput{offset, size});
             }
             self.loop.SetSlot(slot, std::move(executable), std::move(slot_inputs),
                               std::move(slot_outputs));
           },
           py::arg("slot"), py::arg("executable"), py::arg("inputs"), py::arg("outputs"),
           "Registers a slot: its executable, inputs as (offset, bytes, PJRT_Buffer_Type, dims) "
           "and outputs as (offset, bytes) in the arena. Raises ValueError for a place outside "
           "the arena or a size that does not fit its type.")
      .def("drop_slot", [](ArenaHotLoop& self, int64_t slot) { self.loop.DropSlot(slot); },
           py::arg("slot"), "Forgets a slot; an unknown one is ignored.")
      .def("has_slot", [](const ArenaHotLoop& self, int64_t slot) {
             return self.loop.HasSlot(slot);
           }, py::arg("slot"))
      .def("serve", &Serve,
           "Answers HotRuns of registered slots until another frame comes; returns that "
           "frame's first read as (bytes, descriptors, truncated), (b'', [], False) at the end "
           "of the stream. A run's failure is raised (its task is last_task_id), a socket's "
           "as a ConnectionError (SocketError where its errno has none of its own); "
           "nothing else is a ConnectionError.")
      .def("run",
           [](ArenaHotLoop& self, int64_t task_id, int64_t slot, bool zero_copy) {
             py::gil_scoped_release release;
             self.loop.Run(task_id, slot, zero_copy);
           },
           py::arg("task_id"), py::arg("slot"), py::arg("zero_copy"),
           "Runs a registered slot for a task as serve does, without the socket.")
      .def_property_readonly("last_task_id", [](const ArenaHotLoop& self) {
             return self.loop.last_task_id();
           }, "The task of the last run begun, -1 before any.")
      .def("take_used", [](ArenaHotLoop& self) { return self.loop.TakeUsed(); },
           "The slots run since the last call, least recently run first.")
      .def("set_placed_slot",
           [](ArenaHotLoop& self, int64_t slot, std::shared_ptr<Executable> executable,
              const std::vector<std::pair<int, std::vector<int64_t>>>& inputs) {
             self.loop.SetPlacedSlot(slot, std::move(executable), inputs);
           },
           py::arg("slot"), py::arg("executable"), py::arg("inputs"),
           "Registers a slot that runs only as placed runs: inputs as (PJRT_Buffer_Type, dims).")
      .def("run_placed",
           [](ArenaHotLoop& self, int64_t task_id, int64_t slot,
              const std::vector<std::tuple<int64_t, int64_t, int64_t>>& sources,
              const std::vector<std::tuple<int64_t, int64_t, int64_t>>& destinations,
              bool zero_copy) {
             PlacedRequest request;
             request.task_id = task_id;
             request.slot = slot;
             request.zero_copy = zero_copy;
             request.sources = Wheres(sources);
             request.destinations = Wheres(destinations);
             py::gil_scoped_release release;
             self.loop.RunPlaced(request, {});
           },
           py::arg("task_id"), py::arg("slot"), py::arg("sources"), py::arg("destinations"),
           py::arg("zero_copy"),
           "Runs a slot as a placed run does: sources and destinations as (kind, id, offset), "
           "kind 0 a place in a mapped segment (0: the arena), 1 a kept value. Raises "
           "LookupError for an unknown slot, ValueError for a place or value that does not fit.")
      .def("map_segments",
           [](ArenaHotLoop& self, const std::vector<std::tuple<int64_t, int, int64_t>>& segments) {
             for (const auto& [id, fd, size] : segments) {
               if (size <= 0) throw py::value_error("a segment of no bytes");
               self.loop.segments().Map(id, fd, static_cast<size_t>(size));
             }
           },
           py::arg("segments"),
           "Maps segments, given as (id, descriptor, size), and keeps them by id (the "
           "descriptors stay the caller's).")
      .def("forget_segments",
           [](ArenaHotLoop& self, const std::vector<int64_t>& ids) {
             self.loop.segments().Drop(ids);
           },
           py::arg("ids"), "Unmaps segments (once no run or view uses them).")
      .def("segment", [](ArenaHotLoop& self, int64_t id) { return self.loop.segments().Get(id); },
           py::arg("id"), "A mapped segment, as a buffer (it stays mapped while viewed).")
      .def("drop_values",
           [](ArenaHotLoop& self, const std::vector<int64_t>& ids) { self.loop.values().Drop(ids); },
           py::arg("ids"), "Drops kept values (unknown ids are ignored).")
      .def("put_value",
           [](ArenaHotLoop& self, int64_t id, std::shared_ptr<Client> client, int64_t segment,
              int64_t offset, int element_type, const std::vector<int64_t>& dims) {
             std::optional<size_t> size = ArrayBytes(element_type, dims);
             if (!size) throw py::value_error("a value's type has no byte-sized host layout");
             std::shared_ptr<Mapping> mapping = self.loop.segments().Get(segment);
             HostInput input{mapping->At(offset, *size, "a value"), *size, element_type, dims};
             py::gil_scoped_release release;
             self.loop.values().Put(id, DeviceValue::FromHost(std::move(client), input));
           },
           py::arg("id"), py::arg("client"), py::arg("segment"), py::arg("offset"),
           py::arg("element_type"), py::arg("dims"),
           "Copies an array from a place in a mapped segment to the client's device and keeps "
           "it under id.")
      .def("fetch_value",
           [](ArenaHotLoop& self, int64_t id, int64_t segment, int64_t offset) {
             std::shared_ptr<const DeviceValue> value = self.loop.values().Get(id);
             std::shared_ptr<Mapping> mapping = self.loop.segments().Get(segment);
             HostOutput output{mapping->At(offset, value->size(), "a value"), value->size()};
             py::gil_scoped_release release;
             value->ToHost(output);
           },
           py::arg("id"), py::arg("segment"), py::arg("offset"),
           "Copies a kept value into a place in a mapped segment, row-major.")
      .def_property_readonly("value_count", [](ArenaHotLoop& self) {
             return self.loop.values().count();
           })
      .def_property_readonly("value_bytes", [](ArenaHotLoop& self) {
             return self.loop.values().bytes();
           })
      .def_property_readonly("segment_count", [](ArenaHotLoop& self) {
             return self.loop.segments().count();
           }, "Segments mapped, the arena included.");
}
