"""engine/distributed.py: who this process is in a DDP group, the overrides of the ranks other
than 0, unwrapping, and reductions that are no-ops in a single process."""

from __future__ import annotations

import torch

from ampsweep.engine import distributed


def test_rank_from_env_and_rank_overrides():
    assert distributed.from_env({}) == distributed.Rank()
    r1 = distributed.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert (r1.rank, r1.world_size, r1.enabled, r1.is_main) == (1, 2, True, False)
    assert distributed.rank_overrides(distributed.Rank()) == []
    assert "hydra.output_subdir=null" in distributed.rank_overrides(r1)


def test_unwrap_finds_the_plain_module_under_compile_and_ddp_wrappers():
    class Wrapper(torch.nn.Module):  # what DDP looks like: .module and no_sync
        def __init__(self, module):
            super().__init__()
            self.module = module

        def no_sync(self): ...

    plain = torch.nn.Linear(2, 2)
    compiled_like = type("Compiled", (), {"_orig_mod": Wrapper(plain)})()
    assert distributed.unwrap(plain) is plain
    assert distributed.unwrap(Wrapper(plain)) is plain
    assert distributed.unwrap(compiled_like) is plain


def test_reductions_are_no_ops_in_a_single_process():
    t = torch.tensor([3.0])
    assert distributed.all_reduce(t) is t and t.item() == 3.0
    assert distributed.reduce_floats({"a": 1.5}, "sum", torch.device("cpu")) == {"a": 1.5}
    assert distributed.current() == distributed.Rank()


def test_the_module_under_torch_compiles_wrapper_is_found():
    # torch.compile's wrapper keeps the module in a private attribute (torch 2.14.1);
    # compiling happens at the first call, so wrapping alone is cheap
    model = torch.nn.Linear(2, 2)
    assert distributed.uncompiled(torch.compile(model)) is model
    assert distributed.uncompiled(model) is model
