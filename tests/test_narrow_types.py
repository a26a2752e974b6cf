"""ml_dtypes' narrow types (bfloat16, float8_*) load when first needed, by every way in.

worker.dtypes imports ml_dtypes only when a program, an array, a dtype or a
name needs one of its types, so that a process running float32 programs never
pays for it. Each way of meeting a narrow type first is checked in a fresh
process, where nothing imported ml_dtypes before it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

CASES = {
    # A spec's types read from JSON (a manifest, a bundle's index).
    "name": "from worker.records import ArrayType\n"
    "t = ArrayType.from_json({'dtype': 'bfloat16', 'shape': [2]})\n"
    "result = [str(t.dtype), t.nbytes]",
    # An output type the plugin reports by its PJRT code.
    "code": "from worker.dtypes import dtype_of_code\nresult = [str(dtype_of_code(13)), 2]",
    # A user's bfloat16 array, its dtype, and the dtype's name.
    "dtype": "import ml_dtypes, numpy as np\nfrom worker.dtypes import code_of_dtype\n"
    "result = [code_of_dtype(np.dtype(ml_dtypes.bfloat16)), code_of_dtype(np.float32)]",
    "array": "import ml_dtypes, numpy as np\nfrom worker.dtypes import buffer_view\n"
    "view = buffer_view(np.ones(3, ml_dtypes.bfloat16))\n"
    "result = [str(view.dtype), view.tolist()]",
    "floating": "import ml_dtypes, numpy as np\nfrom worker.dtypes import is_floating\n"
    "result = [is_floating(ml_dtypes.float8_e5m2), is_floating(np.int32)]",
}
EXPECTED = {
    "name": ["bfloat16", 4],
    "code": ["bfloat16", 2],
    "dtype": [13, 11],
    "array": ["uint16", [16256, 16256, 16256]],  # bfloat16 1.0 is 0x3f80
    "floating": [True, False],
}


def _fresh(code: str) -> object:
    done = subprocess.run(
        [sys.executable, "-c", f"import json\n{code}\nprint(json.dumps(result))"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("way", sorted(CASES))
def test_a_narrow_type_met_first_in_a_fresh_process(way):
    assert _fresh(CASES[way]) == EXPECTED[way]


def test_float32_work_does_not_import_ml_dtypes():
    code = (
        "import sys, numpy as np\n"
        "from worker.records import ArrayType\n"
        "from worker.dtypes import buffer_view, code_of_dtype, dtype_of_code, is_floating\n"
        "t = ArrayType.from_json({'dtype': 'float32', 'shape': [2]})\n"
        "buffer_view(np.ones(2, np.float32)); is_floating(np.float32)\n"
        "result = [code_of_dtype(t.dtype), str(dtype_of_code(11)), 'ml_dtypes' in sys.modules]"
    )
    assert _fresh(code) == [11, "float32", False]


def test_an_unsupported_dtype_names_every_supported_one():
    code = (
        "from worker.dtypes import code_of_dtype\n"
        "try:\n    code_of_dtype('S3')\nexcept TypeError as error:\n    result = str(error)"
    )
    message = _fresh(code)
    assert isinstance(message, str) and "dtype |S3 is not supported" in message
    assert "bfloat16" in message and "float8_e5m2" in message and "float32" in message
