"""Errors after which a device (and so the worker process that holds it) is unusable.

A CUDA context that met an illegal address, a failed launch, an
uncorrectable ECC error or a lost device stays broken: every later launch,
event or module load in that process fails too ("sticky" errors in CUDA's
terms). A worker that carried on after one would fail every task routed to
it. The worker reports such an error with its reply marked fatal and exits,
and the pool counts it as a crash of the program that met it.

PJRT passes these up as INTERNAL (or UNKNOWN, DATA_LOSS, ABORTED) errors
whose message carries the driver's or runtime's name for them, so they are
recognised by code and message together.
"""

from __future__ import annotations

import re

# PJRT_Error_Code values that a device failure arrives with.
_DEVICE_FAILURE_CODES = frozenset({2, 10, 13, 15})  # UNKNOWN, ABORTED, INTERNAL, DATA_LOSS

_STICKY = re.compile(
    "|".join(
        [
            # CUDA driver API names of the sticky errors.
            r"CUDA_ERROR_(?:ILLEGAL_ADDRESS|ILLEGAL_INSTRUCTION|MISALIGNED_ADDRESS"
            r"|INVALID_ADDRESS_SPACE|INVALID_PC|LAUNCH_FAILED|HARDWARE_STACK_ERROR"
            r"|ECC_UNCORRECTABLE|ASSERT|LAUNCH_TIMEOUT|CONTEXT_IS_DESTROYED|DEVICE_UNAVAILABLE"
            r"|NVLINK_UNCORRECTABLE|EXTERNAL_DEVICE)",
            # The runtime API's names and the driver's descriptions of them.
            r"cudaError(?:IllegalAddress|IllegalInstruction|MisalignedAddress|LaunchFailure"
            r"|HardwareStackError|ECCUncorrectable|Assert|DevicesUnavailable)",
            r"an illegal memory access was encountered",
            r"unspecified launch failure",
            r"uncorrectable ECC error",
            r"device-side assert triggered",
            r"GPU (?:is lost|has fallen off the bus)",
            # ROCm's equivalents.
            r"hipError(?:IllegalAddress|LaunchFailure|ECCNotCorrectable|Assert)",
            r"HSA_STATUS_ERROR_(?:MEMORY_APERTURE_VIOLATION|EXCEPTION|ILLEGAL_INSTRUCTION)",
        ]
    )
)


def fatal_device_error(error: BaseException) -> str | None:
    """Returns the name of the device failure an error reports, or None if it reports none.

    Only errors from the plugin count (a PjrtError, which has a `code`):
    an error a program raised itself, such as a bad argument, never ends a
    worker.
    """
    code = getattr(error, "code", None)
    if not isinstance(code, int) or code not in _DEVICE_FAILURE_CODES:
        return None
    found = _STICKY.search(str(error))
    return found.group(0) if found else None
