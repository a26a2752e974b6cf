"""jaxlib's own CPU client as a runtime: the XLA that jax.jit runs on, without JAX.

A CPU PJRT plugin is one jaxlib's XLA built apart (lammps-jax-pjrt-cpu is
jaxlib 0.11.2's); another build of XLA than the installed jaxlib's gives
other last bits for the same program (matrix products, convolutions), so
results differ from the user's jax.jit. jaxlib exports no PJRT C API for its
CPU client, so the ``cpu`` platform uses it through jaxlib's Python bindings,
in the process that runs the programs (a pool worker, or the user's own),
importing jaxlib but never jax. worker.plugin.runtime holds it as it holds a
plugin: these classes have the methods of the native module's.

    calls.py       every call into jaxlib (most of them private): making a client,
                   compiling, (de)serializing, arrays in and out, FFI targets, versions;
                   JaxlibApiError when the installed jaxlib moved one
    executable.py  JaxlibExecutable: a loaded program, run on host arrays and on values
                   kept on the device, over one device or several
    client.py      JaxlibPlugin and JaxlibClient: the runtime's handle and client, and
                   how many devices a client has (JAX's count: it changes results)
"""
