"""A fake ``pynvml`` (nvidia-ml-py) for tests on machines without a GPU: the functions ddprun's
gpufacts calls, answering from a spec.

The spec is a dict set by :func:`install` (unit tests load this file as a module) or read at
``nvmlInit()`` from the JSON file named by FAKE_NVML_SPEC (multiprocess tests put this directory
first on a node's PYTHONPATH, so ``import pynvml`` finds it). Spec::

    {"driver": "550.54.15", "cuda": 12040, "init_error": null,
     "gpus": [{"name": ..., "uuid": ..., "memory": bytes, "cc": [9, 0], "mig": 0, "ecc": 0,
               "retired_pending": 0, "remap": [corr, unc, pending, failed], "throttle": bitmask,
               "pcie": [gen, max_gen, width, max_width], "nvlink": [1, 1, 0, ...]}]}

A GPU field that is missing or null answers NVML_ERROR_NOT_SUPPORTED, as NVML does on GPUs without it.
"""

import json
import os
from types import SimpleNamespace

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0

_SPEC: dict | None = None
CALLS: list[str] = []
"""Names of the functions called, in order (tests assert init/shutdown pairing)."""


class NVMLError(Exception):
    def __init__(self, value: int, text: str = ""):
        self.value = value
        super().__init__(text or {3: "Not Supported", 2: "Invalid Argument", 12: "NVML Shared Library Not Found"}
                         .get(value, f"NVML error {value}"))


def install(spec: dict | None) -> None:
    global _SPEC
    _SPEC = spec
    CALLS.clear()


def _field(handle: int, key: str):
    value = _SPEC["gpus"][handle].get(key)
    if value is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return value


def nvmlInit():
    global _SPEC
    CALLS.append("nvmlInit")
    if _SPEC is None and os.environ.get("FAKE_NVML_SPEC"):
        with open(os.environ["FAKE_NVML_SPEC"]) as fp:
            _SPEC = json.load(fp)
    if _SPEC is None or _SPEC.get("init_error"):
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)


def nvmlShutdown():
    CALLS.append("nvmlShutdown")


def nvmlSystemGetDriverVersion():
    return _SPEC["driver"]


def nvmlSystemGetCudaDriverVersion():
    return _SPEC["cuda"]


def nvmlDeviceGetCount():
    return len(_SPEC["gpus"])


def nvmlDeviceGetHandleByIndex(index):
    if not 0 <= index < len(_SPEC["gpus"]):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return index


def nvmlDeviceGetHandleByUUID(uuid):
    for i, gpu in enumerate(_SPEC["gpus"]):
        if gpu.get("uuid") == uuid:
            return i
    raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)


def nvmlDeviceGetIndex(h):
    return h


def nvmlDeviceGetName(h):
    return _field(h, "name")


def nvmlDeviceGetUUID(h):
    return _field(h, "uuid")


def nvmlDeviceGetMemoryInfo(h):
    total = _field(h, "memory")
    return SimpleNamespace(total=total, free=total, used=0)


def nvmlDeviceGetCudaComputeCapability(h):
    return tuple(_field(h, "cc"))


def nvmlDeviceGetMigMode(h):
    return [_field(h, "mig"), _field(h, "mig")]


def nvmlDeviceGetTotalEccErrors(h, error_type, counter_type):
    if (error_type, counter_type) != (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _field(h, "ecc")


def nvmlDeviceGetRetiredPagesPendingStatus(h):
    return _field(h, "retired_pending")


def nvmlDeviceGetRemappedRows(h):
    return tuple(_field(h, "remap"))


def nvmlDeviceGetCurrentClocksEventReasons(h):
    return _field(h, "throttle")


def nvmlDeviceGetCurrPcieLinkGeneration(h):
    return _field(h, "pcie")[0]


def nvmlDeviceGetMaxPcieLinkGeneration(h):
    return _field(h, "pcie")[1]


def nvmlDeviceGetCurrPcieLinkWidth(h):
    return _field(h, "pcie")[2]


def nvmlDeviceGetMaxPcieLinkWidth(h):
    return _field(h, "pcie")[3]


def nvmlDeviceGetNvLinkState(h, link):
    links = _SPEC["gpus"][h].get("nvlink") or []
    if link >= len(links):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED if not links else NVML_ERROR_INVALID_ARGUMENT)
    return links[link]
