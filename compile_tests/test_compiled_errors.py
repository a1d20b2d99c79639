"""An argument error in compiled code carries funcoll's eager message.

funcoll checks its arguments in Python before communicating, so under
``torch.compile`` the check runs while dynamo traces. Without ``fullgraph``
dynamo gives up on the frame and runs it eagerly, so the caller gets funcoll's
own ``ValueError``/``TypeError``. With ``fullgraph=True`` dynamo may not fall
back: it raises ``torch._dynamo.exc.Unsupported`` ("Observed exception"), whose
message quotes funcoll's error in full and, from torch 2.12 on, whose
``__cause__`` chain holds it (on 2.11 the chain names only the exception's type)
(docs/errors.md, "Errors in compiled code"). Errors found at run time (the
cross-rank checks, the static ops' checked counts) are raised by the compiled
code itself, with funcoll's type and message: compile_tests/test_checked_ops.py.

One process, no process group: every op validates its arguments before it
looks at the group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import funcoll

X = torch.ones(3, 2)
BAD: dict[str, tuple[Callable[[torch.Tensor], Any], type[Exception]]] = {
    "gather-dim": (lambda x: funcoll.gather(x, dim=5), ValueError),
    "all_gather-dim": (lambda x: funcoll.all_gather(x, dim=-4), ValueError),
    "all_to_all-scatter_sizes": (
        lambda x: funcoll.all_to_all(x, None, 0, 1, scatter_sizes=[1, 2]),
        ValueError,
    ),
    "gather_padded-length": (lambda x: funcoll.gather_padded(x, 7), ValueError),
    "reduce_scatter-op": (lambda x: funcoll.reduce_scatter(x, op="mean"), ValueError),
    "all_to_all_v-send_sizes": (lambda x: funcoll.all_to_all_v(x, [1.5]), TypeError),
    "ppermute-perm": (lambda x: funcoll.ppermute(x, [(0, 3)]), ValueError),
}


def _eager_error(call: Callable[[torch.Tensor], Any], kind: type[Exception]) -> str:
    with pytest.raises(kind) as info:
        call(X)
    message = str(info.value)
    assert message.startswith("funcoll."), message
    return message


@pytest.mark.parametrize("case", list(BAD))
def test_without_fullgraph_the_same_error(case: str) -> None:
    call, kind = BAD[case]
    message = _eager_error(call, kind)
    torch._dynamo.reset()
    with pytest.raises(kind) as info:
        torch.compile(call, backend="eager")(X)
    assert str(info.value) == message


@pytest.mark.parametrize("case", list(BAD))
def test_fullgraph_quotes_the_error(case: str) -> None:
    call, kind = BAD[case]
    message = _eager_error(call, kind)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(call, backend="eager", fullgraph=True)(X)
    assert repr(message) in str(info.value) or message in str(info.value), str(info.value)
    if torch.__version__ < "2.12":  # dynamo 2.11's cause: "raised exception ExceptionVariable(<class ...>)"
        return
    chain, e = [], info.value.__cause__
    while e is not None:
        chain.append(str(e))
        e = e.__cause__
    assert any(message in c for c in chain), chain
