"""Where each public op is tested: the tests' own table, read by tests/test_specs.py.

`TESTS`: the modules that check the op against single-process references.
`COMPILED_IN`: the compile test that compiles it: the case table
(``compile_tests/_ops.py``, a case id starting with the op's name, or with
`CASE_PREFIX`'s), a module of its own, or None for a setting read outside
compiled code. Adding an op adds its row here with its test cases.
"""

from __future__ import annotations

CASES = "compile_tests/_ops.py"  # the table of compiled cases (id prefix: the op name)
_EVEN, _RAGGED, _REGION = "tests/test_even.py", "tests/test_ragged.py", "tests/test_region.py"
_DT, _SIZES, _PROPS = "tests/test_dtensor.py", "tests/test_sizes.py", "tests/test_properties.py"
_DT_COMPILED = "compile_tests/test_dtensor_compile.py"

TESTS: dict[str, tuple[str, ...]] = {
    "all_gather": (_EVEN, "tests/test_checks.py", _DT),
    "all_gather_into_tensor": (_EVEN,),
    "reduce_scatter": (_EVEN, _RAGGED, _SIZES, _DT),
    "all_reduce": (_EVEN, _DT),
    "all_to_all": (_EVEN, "tests/test_all_to_all_sizes.py", _SIZES, _DT),
    "ppermute": (_EVEN, _DT),
    "broadcast": (_EVEN, _DT),
    "reduce": (_EVEN, _PROPS),
    "gather": (_RAGGED, "tests/test_ragged_errors.py", _DT),
    "all_gather_list": (_RAGGED,),
    "all_gather_ragged": (_RAGGED, _DT),
    "scatter": (_PROPS, "tests/test_ragged_errors.py"),
    "all_to_all_v": (_RAGGED, _SIZES),
    "gather_padded": ("tests/test_static.py",),
    "all_to_all_padded": ("tests/test_static.py",),
    "split_forward_gather_backward": (_REGION, _DT),
    "gather_forward_split_backward": (_REGION, _DT),
    "from_ragged": (_DT,),
    "to_ragged": (_DT,),
    "axis_index": ("tests/test_group.py",),
    "axis_size": ("tests/test_group.py",),
    "split_sizes": ("tests/test_all_to_all_sizes.py",),
    "mark_ragged": ("compile_tests/test_recompiles.py",),
    "allow_compile_caches": ("compile_tests/test_compile_caches.py",),
    "set_checks": ("tests/test_checks.py",),
    "checks_enabled": ("tests/test_checks.py",),
    "shard_map": ("tests/test_lax.py", "tests/test_lax_jax.py"),
    "typeof": ("tests/test_lax.py",),
    "wait": ("tests/test_overlap.py",),
}

# Ops compiled elsewhere than the case table (None: a setting read outside compiled code).
COMPILED_IN: dict[str, str | None] = {
    "from_ragged": _DT_COMPILED,
    "to_ragged": _DT_COMPILED,
    "split_sizes": "tests/clients/test_clients.py",
    "mark_ragged": "compile_tests/test_downstream.py",
    "allow_compile_caches": "compile_tests/test_compile_caches.py",
    "set_checks": "compile_tests/test_checked_ops.py",
    "checks_enabled": None,
    "shard_map": "compile_tests/test_lax_compile.py",
    "typeof": "compile_tests/test_lax_compile.py",
    "wait": "compile_tests/test_overlap_order.py",
}
CASE_PREFIX = {"axis_size": "axis_index"}  # compiled by the cases of another op
