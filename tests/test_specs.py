"""The kernel specs are the one declaration of what each kernel takes: the C header is generated
from them, and every optimizer's scalars and states follow them."""
import pytest
import torch

import fastoptim
from fastoptim.kernels import header
from fastoptim.specs import COMMON_SCALARS, KernelSpec, Role, declared_specs

from . import oracle
from .registry import OPTIMIZERS


def test_the_committed_c_header_is_what_the_specs_generate():
    assert header.PATH.read_text() == header.c_header(declared_specs()), (
        "fastoptim/kernels/fused_cpu_specs.h is stale: run `python scripts/c_header.py` and rebuild")


def test_the_header_gives_every_kernel_its_rows_scalars_and_flags_in_spec_order():
    text = header.c_header(declared_specs())
    for spec in declared_specs():
        prefix = spec.name.upper() + "_"
        rows = [prefix + name.upper() for name in spec.states] + [prefix + "STATES_END"]
        scalars = [prefix + name.upper() for name in spec.scalars]
        assert ", ".join([rows[0] + " = FIRST_STATE"] + rows[1:]) in text  # a spec of no state: its end only
        assert ", ".join([scalars[0] + " = COMMON_SCALARS"] + scalars[1:]) in text
        for i, flag in enumerate(spec.flags):
            assert f"{prefix}{flag.upper()} = {1 << (i + 1)}" in text
        assert f"{prefix}GRAD = {spec.grad.upper() if spec.grad else -1} }}" in text
    assert "X(lion, LION)" in text and "MUON_APPLY_GRAD = BF16 }" in text


@pytest.mark.parametrize("cls", [info.cls for info in OPTIMIZERS], ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("state_bits", [32, 8])
def test_an_optimizer_gives_its_kernel_every_scalar_of_its_spec_and_keeps_the_states_it_names(cls, state_bits):
    params = oracle.make_params([(64, 80)])
    optimizer = cls(params, lr=1e-3, state_bits=state_bits)
    seen = []
    algorithm = cls.algorithm
    optimizer.algorithm = algorithm._replace(
        kernel_scalars=lambda args: seen.append(algorithm.kernel_scalars(args)) or seen[-1])
    params[0].grad = torch.randn_like(params[0])
    optimizer.step()
    if algorithm.kernel_scalars is None:  # no kernel of its own (Muon's runs its momentum half's spec)
        assert not seen and not algorithm.spec.scalars
    else:
        assert seen and set(seen[0]) == set(algorithm.spec.all_scalars) - {"found_inf", "seed"}
    kept = algorithm.spec.kept(algorithm.flags(optimizer.param_groups[0]))
    assert {key for key in optimizer.state[params[0]] if key in algorithm.spec.states} == set(kept)


def test_a_spec_refuses_a_role_declared_twice_a_flag_it_does_not_declare_or_a_grad_format_no_kernel_reads():
    with pytest.raises(ValueError, match="declared twice"):
        KernelSpec("x", (Role("m"), Role("m")), ())
    with pytest.raises(ValueError, match="declared twice"):
        KernelSpec("x", (Role("m"),), (COMMON_SCALARS[0],))
    with pytest.raises(ValueError, match="undeclared flag"):
        KernelSpec("x", (Role("m", when="nesterov"),), ())
    with pytest.raises(ValueError, match="no grad format 'fp16'"):
        KernelSpec("x", (Role("m"),), (), grad="fp16")


def test_flag_bits_follow_the_spec_order_after_stochastic_rounding():
    spec = fastoptim.AdamW.algorithm.spec
    assert spec.flag_bits(dict(amsgrad=True, first_moment=False)) == 2
    assert spec.flag_bits(dict(amsgrad=False, first_moment=True), stochastic_rounding=True) == 5
