"""State dicts of fastoptim optimizers: what :class:`FastOptimizer` saves and how it loads its own
and its peers' (official Adan, timm, torch.optim.AdamW, the seed's AdamwSN), converting each state
into this optimizer's format."""
from copy import deepcopy

import torch

from .. import distributed
from ..multi_tensor import gather_states
from ..optimizer_state import OptimizerState
from ..specs import ABSMAX
from ..states import formats, master, subset_norm
from .algorithm import PER_GROUP, PER_PARAM
from .checks import normalize_betas, one_value, step_count
from .state_creation import outside_inference_mode

# Options that say how a step runs, not what it computes: a loaded state dict leaves them as they are.
EXECUTION_OPTIONS = ("foreach", "fused", "state_bits", "master_bits", "capturable", "differentiable")
# Not an option of the groups (see FastOptimizer.__init__), but ZeroRedundancyOptimizer copies every argument
# of its optimizer into them: a state dict leaves it out (a process group cannot be pickled, and ZeRO's
# consolidate_state_dict pickles each rank's), and a loaded one is not taken from the saved groups.
NOT_SAVED = ("shard_group",)
# Options of peers' saved groups that select a variant of the algorithm, which fastoptim does not
# implement: name, the value that means the plain algorithm, and what the variant is. A group that
# sets one otherwise is refused at load, where it would continue as the plain algorithm.
PEER_VARIANTS = (("caution", False, "timm's cautious variant (updates masked where they disagree with the grad)"),
                 ("corrected_weight_decay", False, "timm's weight decay scaled by lr / max lr"),
                 ("clipping_threshold", None, "timm's update clipping"))


class StateDicts:
    """The state-dict half of :class:`fastoptim.optimizers.base.FastOptimizer`."""

    def state_dict(self):
        """torch's, except that the 8-bit states of DTensor params come dequantized, as fp32 DTensors:
        their blocks are per local shard, so only their values can be resharded. Loading quantizes
        them again, into the very codes and block maxima on the same shards. Other 8-bit states name
        their code table where a state naming none would be read in another (Muon's momentum:
        fastoptim.states.formats.named_codes). Each param's state is a
        plain dict (``torch.load(weights_only=True)`` knows no other kind); other entries of
        ``state`` (a hook's) are saved as they are, as torch saves them. The master remainder of a
        param written since the last step is saved as zeros, which its written value goes with.
        Optional states that no counted step has read yet (made by a compiled step that GradScaler
        skipped: zeros) are left out, so that the step after a load reads them first, as this one would."""
        self._restart_written_masters()
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:  # torch's copies
            for key in NOT_SAVED:
                group.pop(key, None)
        state_dict["state"] = {key: dict(state) if isinstance(state, dict) else state
                               for key, state in state_dict["state"].items()}
        specs = {key: self._algorithm(group).spec for group in state_dict["param_groups"] for key in group["params"]}
        # a param's states of the other algorithm, kept since its group changed algorithm (Muon's), by name
        roles = {role.name: role for algorithm in self._algorithms() for role in algorithm.spec.roles}
        for key in self._unread_keys(state_dict):
            state_dict["state"][key] = {role: value for role, value in state_dict["state"][key].items()
                                        if role.removesuffix(ABSMAX) not in specs[key].optional}
        for key, state in state_dict["state"].items():
            if key not in specs:
                continue
            for role in [roles[role] for role in state if role + ABSMAX in state]:  # 8-bit codes
                state = state | formats.named_codes(role)
                if self._sharded:
                    state = formats.convert(state, role, formats.FP32)
            state_dict["state"][key] = state
        return state_dict

    def _unread_keys(self, state_dict):
        """The keys in ``state_dict`` (this optimizer's, just made) of the params whose optional states
        no counted step has read yet: 0 in their group's first-read marks (``PlanStore.first_reads``)."""
        for index, (group, saved) in enumerate(zip(self.param_groups, state_dict["param_groups"])):
            held = self._plans.reads.get(index)
            if held is not None and held[0] == tuple(map(id, group["params"])):
                yield from (key for key, mark in zip(saved["params"], held[1].tolist())
                            if mark == 0 and key in state_dict["state"])

    @outside_inference_mode
    def load_state_dict(self, state_dict):
        """Load a state dict of this optimizer or of its peers' layout (see the class docstring).

        As in torch, the load pre-hooks see the dict first (and may replace it), and the post-hooks
        run last. Everything is checked before anything changes. The hyperparameters are the saved
        ones, ``max_grad_norm`` included (the saved groups must agree on it), but the execution
        options (``foreach``, ``fused``, ``state_bits``, ``master_bits``, and AdamW's ``capturable``
        and ``differentiable``) stay this optimizer's: a state moves freely between engines, and is
        converted to this optimizer's state format (quantized, or dequantized; a master remainder
        to this optimizer's bits, dropped under ``master_bits=16``, zeros where none was saved). States are on the
        parameter's device (float64 for a float64 parameter), whatever the saved device. A state of
        this algorithm that the saved options leave unused (``max_exp_avg_sq`` after amsgrad was
        turned off) is kept as it was saved, as torch keeps it, and so are the saved ``state``'s
        entries that are no param's (a hook's).
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        groups, saved_groups = self.param_groups, deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups) or any(
                len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict does not match the optimizer's parameter groups: "
                             f"{[len(s['params']) for s in saved_groups]} params saved, "
                             f"{[len(g['params']) for g in groups]} here")
        # max_grad_norm is global: the saved one is taken, as torch takes the other hyperparameters
        max_grad_norms = {saved.get("max_grad_norm", self.defaults["max_grad_norm"]) for saved in saved_groups}
        if len(max_grad_norms) > 1:
            raise ValueError(f"loaded param groups disagree on max_grad_norm ({sorted(max_grad_norms)}), "
                             "which clips by the norm over all groups")
        max_grad_norm = max_grad_norms.pop() if max_grad_norms else self.defaults["max_grad_norm"]
        own_options = [key for key in EXECUTION_OPTIONS if key in self.defaults]
        new_groups, new_state = [], {}
        for index, (group, saved) in enumerate(zip(groups, saved_groups)):
            for option, plain, variant in PEER_VARIANTS:
                if saved.get(option, plain) != plain:
                    raise ValueError(
                        f"loaded param group {index} sets {option}={saved[option]!r}: {variant}, which "
                        f"{type(self).__name__} does not implement, so it would continue as another algorithm. "
                        f"Resume it with the optimizer that saved it, or set {option} to {plain!r} in the saved "
                        "groups to continue with the plain algorithm")
            # the saved keys in their order (as torch keeps them), then defaults the saved group lacks
            merged = {key: value for key, value in saved.items() if key not in NOT_SAVED}
            merged |= {key: value for key, value in self.defaults.items() if key not in merged}
            merged |= {"max_grad_norm": max_grad_norm, **{key: group[key] for key in own_options},
                       "params": group["params"]}
            if "param_names" in group and "param_names" not in saved:
                merged["param_names"] = group["param_names"]
            try:
                normalize_betas(merged)
                self._check_group(merged, max_grad_norm)
                self._convert_saved_count(merged)
            except ValueError as error:
                n_betas = self._algorithm(merged).n_betas
                raise ValueError(f"loaded param group {index}: {error}. Is it a state dict of another "
                                 f"optimizer? {type(self).__name__} expects {n_betas} betas.") from None
            for saved_id, param in zip(saved["params"], group["params"]):
                if state_dict["state"].get(saved_id):
                    new_state[param] = self._load_state(dict(state_dict["state"][saved_id]), merged, param, saved_id)
                elif saved_id in state_dict["state"]:  # a state cleared by hand: the next step makes it anew
                    new_state[param] = {}
            new_groups.append(merged)
            if not self._viewed:  # the loaded copies go into flat buffers, as new states do
                gather_states([new_state[param] for param in group["params"] if param in new_state])
        saved_params = {saved_id for saved in saved_groups for saved_id in saved["params"]}
        new_state |= {key: value for key, value in state_dict["state"].items() if key not in saved_params}
        # made before anything is set: an entry that is no param's may hold a count that it refuses
        self.__setstate__({"state": OptimizerState(new_state), "param_groups": new_groups})
        self.defaults["max_grad_norm"] = self._max_grad_norm = max_grad_norm
        self._forget_plans()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_state(self, state, group, param, saved_id):
        """One saved per-parameter state, checked and converted into this optimizer's formats, on
        ``param``'s device."""
        # an empty dict is no state's value: torch's flatten_optimizer_state_dict=True rebuilds a state from the
        # keys this optimizer holds, {} for one the checkpoint lacks (block maxima a sharded state saved without)
        state = {key: value for key, value in state.items() if not (type(value) is dict and not value)}
        try:
            subset_norm.check_record(param.shape, state)
        except ValueError as error:
            raise ValueError(f"state of parameter {saved_id}: {error}") from None
        algorithm = self._algorithm(group)
        spec = algorithm.spec
        others = [other for other in self._algorithms() if other is not algorithm]  # Muon's companions, say
        # into this optimizer's formats: the group's algorithm's states, and those a param kept of the other's
        # (Muon's, whose group changed algorithm), as a step back to it takes them
        for each in (algorithm, *others):
            for role, state_format in self._formats(group, param, state, each)[0].items():
                if role in state and (each is algorithm or role not in spec.states):
                    try:
                        state = formats.convert(state, each.spec.role(role), state_format)
                    except (ValueError, RuntimeError) as error:
                        raise ValueError(f"state of parameter {saved_id}: {error}") from None
        remainder = state.pop(master.KEY, None)
        master_bits = one_value("master_bits", group["master_bits"])
        if remainder is not None and master.dtype(param, master_bits) is not None:
            state[master.KEY] = master.convert(torch.as_tensor(remainder), master_bits)
        expected = self._expected_state(group, param, state)
        # the states a param kept of the other algorithm (Muon's, whose group changed algorithm), in the formats a
        # step back to it takes
        kept = {key: shape_dtype for other in others
                for key, shape_dtype in self._expected_state(group, param, state, other).items()
                if key.removesuffix(ABSMAX) in state and key.removesuffix(ABSMAX) in other.spec.states
                and key.removesuffix(ABSMAX) not in spec.states}
        records = {key for key in subset_norm.RECORDS if key in state}  # the partition: Python ints
        # the states its options leave unused (AdamW's maximum without amsgrad), or the other algorithm's (a Muon
        # group's param stepped by the AdamW companions before), kept as the step keeps them
        unused = {key for algorithm in self._algorithms() for key in (
            *(key for role in algorithm.spec.states for key in (role, role + ABSMAX)),
            *(("step",) if algorithm.counts == PER_PARAM else ()))} - set(expected)
        # a step creates a remainder, and a state that an option's flag turned on since (amsgrad's maximum, AdamWSN's
        # first moment once β1 > 0) for a param it found without it, as it does for one that had no grad since; not
        # one that the algorithm always keeps (AdamW's first moment: an RMSPropSN state dict is another's)
        flagged = {role.name for role in spec.roles if role.when is not None and role.when not in algorithm.fixed_flags}
        missing = {key for key in set(expected) - set(state) - spec.optional - {master.KEY}
                   if key.removesuffix(ABSMAX) not in flagged or key.removesuffix(ABSMAX) in state}
        if set(state) - set(expected) - records - unused or missing:
            raise ValueError(
                f"state of parameter {saved_id} has keys {sorted(state)}, but {type(self).__name__} "
                f"expects {sorted(expected)}: is it a state dict of another optimizer?")
        expected |= kept
        for key in [key for key in state if key not in records]:
            if key not in expected:  # a state the saved options leave unused: kept as saved
                state[key] = torch.as_tensor(state[key]).to(param.device, copy=True)
                continue
            if key == "step":  # a count: checked as official Adan's group count is, at load
                state[key] = step_count(state[key], param.device, f"step of parameter {saved_id}")
                continue
            (shape, dtype), value = expected[key], torch.as_tensor(state[key])
            if value.shape != shape:
                raise ValueError(f"state '{key}' of parameter {saved_id} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(shape)}")
            if (key in spec.states or key in kept and not key.endswith(ABSMAX)) and distributed.is_dtensor(param) \
                    and not distributed.is_dtensor(value):
                raise ValueError(f"state '{key}' of parameter {saved_id} is a plain tensor, but its param "
                                 "is a DTensor: load sharded states through torch.distributed.checkpoint "
                                 "(see the README)")
            state[key] = value.to(device=param.device, dtype=dtype, copy=True)
        return state

    def _convert_saved_count(self, group):
        """A ``PER_GROUP`` algorithm's saved ``step`` as a 0-d fp32 tensor on the group's device, in
        place (official Adan and timm keep an integer, and none before their first step); a
        ValueError if it is not a whole number >= 0."""
        if self._algorithm(group).counts == PER_GROUP:
            group["step"] = step_count(group.get("step", 0), group["params"][0].device if group["params"] else None)
