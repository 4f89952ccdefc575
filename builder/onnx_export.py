"""`--export_onnx`: an engine's step program as ONNX, each plugin op one node of the domain `inkling.plugins`.

This is the form TensorRT's ONNX parser takes plugins in: a node whose op_type is the plugin's name,
whose inputs are the op's tensor arguments (in the op's order, docs/interfaces.md "Ops") and whose
attributes are its non-tensor arguments (bank_attention's window, scale and log-scaling floor,
sigmoid_sink_moe's top_k, route_scale and tile_configs, every plugin's impl; an argument the graph leaves at
its default is written with that value) plus the plugin's `version` (and `weight_layout_version` where it
reads packed weights). Everything else is
standard ONNX (torch.onnx's dynamo exporter, opset 18+).

Mutating plugins (kv_cache_write, sconv) become functional nodes: after the op's own
outputs, one extra output per argument the op writes in place (in argument order), as ONNX LLM
exports write past -> present. The graph threads each new cache/state into the next node that reads
it, and the final values are graph outputs `<input>_out` (e.g. `key_caches_0_out`, `conv_states_3_out`);
a runtime binds each to the same buffer as its input, which is what the engine's in-place op does.

How: `ExportedProgram.run_decompositions({})` functionalises the engine's program (mutating custom ops
become `auto_functionalized_v2`, which torch.onnx cannot translate); each of those nodes is replaced by
a call of the op's functional twin `inkling_onnx::<name>` (same arguments, returns outputs + new
states; registered here with a fake, its eager impl clones and calls the real op); then
`torch.onnx.export` translates the twins and the non-mutating plugins through `custom_translation_table`.

Dynamic dims keep their symbolic names (num_tokens, batch, num_blocks_<j> for each KV pool, ...). A plugin argument that
is a SymInt derived from shapes (`max_seqlen_q` of the attention) cannot be a static ONNX attribute,
so it is an int64 scalar input of its node instead.

Weights: graph inputs by default (`weights="inputs"`, named `weights_<name with . as _>`), as in the
engine, where the runtime owns them; the file stays small whatever the model size. `weights="external"`
stores them as initializers in an external data file beside the model (`<file>.data`), which is
what a >2 GB model needs.
"""

from __future__ import annotations

import inspect
import json
import operator
import os
import re
import warnings
from typing import Any

import torch
from torch.export.graph_signature import OutputKind

import plugins

PLUGIN_DOMAIN = "inkling.plugins"
PLUGIN_DOMAIN_VERSION = 1
TWIN_NAMESPACE = "inkling_onnx"
# Plugin arguments typed int in the op schema whose value is a SymInt of the graph (not an attribute).
SCALAR_INPUTS = frozenset({"max_seqlen_q"})

_twin_lib: torch.library.Library | None = None
_twins: dict[str, torch._ops.OpOverload] = {}


# Functional twins of the mutating plugins.


def _mutated_args(op: torch._ops.OpOverload) -> list[int]:
    return [
        i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    ]


def functional_twin(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """`inkling_onnx::<name>(same args) -> (outputs..., new value of each mutated arg...)`."""
    global _twin_lib
    name = op._schema.name.split("::")[-1]
    if name in _twins:
        return _twins[name]
    if _twin_lib is None:
        _twin_lib = torch.library.Library(TWIN_NAMESPACE, "FRAGMENT")
    mutated = _mutated_args(op)
    args = ", ".join(f"{a.type} {a.name}" for a in op._schema.arguments)
    returns = [str(r.type) for r in op._schema.returns] + ["Tensor"] * len(mutated)
    _twin_lib.define(f"{name}({args}) -> ({', '.join(returns)})")

    def twin(*args: Any) -> tuple[torch.Tensor, ...]:
        args = list(args)
        for i in mutated:
            args[i] = args[i].clone()
        out = op(*args)
        outs = () if out is None else (tuple(out) if isinstance(out, (tuple, list)) else (out,))
        return (*outs, *(args[i] for i in mutated))

    _twin_lib.impl(name, twin, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{TWIN_NAMESPACE}::{name}", twin, lib=_twin_lib)
    _twins[name] = getattr(getattr(torch.ops, TWIN_NAMESPACE), name).default
    return _twins[name]


def _drop_derived_ranges(program: torch.export.ExportedProgram) -> None:
    """Forget the value ranges a loaded program's shape environment keeps for expressions of its dims
    (`batch + 1`, cu_seqlens' length): re-tracing it (run_decompositions) expects every key to be a
    symbol and fails on them (torch 2.11 and 2.13, programs read back from .pt2). Each is implied by the
    ranges of the symbols it is made of."""
    import sympy
    from torch._export.utils import _get_shape_env_from_gm

    env = _get_shape_env_from_gm(program.graph_module)
    if env is not None:
        for key in [k for k in env.var_to_range if not isinstance(k, sympy.Symbol)]:
            del env.var_to_range[key]


def functionalize(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The program with in-place plugin calls replaced by their functional twins (a new program)."""
    _drop_derived_ranges(program)
    ep = program.run_decompositions({})
    graph = ep.graph_module.graph
    hop = torch.ops.higher_order.auto_functionalized_v2
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not hop:
            continue
        op = node.args[0]
        if not str(op._schema.name).startswith(f"{plugins.registry.NAMESPACE}::"):
            raise NotImplementedError(f"in-place op {op} is not an inkling plugin")
        schema_args = op._schema.arguments
        mutated = _mutated_args(op)
        kw = node.kwargs
        bases = kw["_all_bases"]
        call_args, base_to_out = [], {}
        n_outs = len(op._schema.returns)
        for i, a in enumerate(schema_args):
            if i not in mutated:
                call_args.append(kw[a.name])
                continue
            extra = [k for k in kw if k.startswith(f"_{a.name}_") and k != f"_{a.name}_base_index"]
            b = kw[f"_{a.name}_base_index"]
            if extra or b is None or b in base_to_out:
                raise NotImplementedError(
                    f"{op}: argument {a.name} is a view or aliases another argument; "
                    "the ONNX export needs each written tensor to be a whole graph tensor"
                )
            call_args.append(bases[b])
            base_to_out[b] = n_outs + mutated.index(i)
        with graph.inserting_before(node):
            twin = graph.call_function(functional_twin(op), tuple(call_args))
        twin.meta = dict(node.meta)
        # auto_functionalized_v2 returns (out or outs..., new bases...); None-returning ops keep a slot.
        offset = max(1, n_outs)
        vals = node.meta.get("val")
        if vals is not None:
            new_vals = [None] * (n_outs + len(mutated))
            for i in range(n_outs):
                new_vals[i] = vals[i]
            for b, j in base_to_out.items():
                new_vals[j] = vals[offset + b]
            twin.meta["val"] = tuple(new_vals)
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise NotImplementedError(f"unexpected use of {node.name}: {user.format_node()}")
            idx = user.args[1]
            user.args = (twin, idx if idx < n_outs else base_to_out[idx - offset])
        graph.erase_node(node)
    graph.lint()
    ep.graph_module.recompile()
    return _mutations_as_outputs(ep)


def _mutations_as_outputs(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Input mutations become plain outputs after the user outputs (torch.onnx drops mutation outputs);
    each output spec's target keeps the name of the input it updates."""
    from torch.export.exported_program import ExportedProgram, ModuleCallEntry, ModuleCallSignature
    from torch.export.graph_signature import ExportGraphSignature, OutputSpec

    sig = ep.graph_signature
    kinds = {s.kind for s in sig.output_specs}
    if not kinds <= {OutputKind.USER_OUTPUT, OutputKind.USER_INPUT_MUTATION}:
        raise NotImplementedError(f"output kinds {kinds}: only user outputs and input mutations export")
    order = [i for i, s in enumerate(sig.output_specs) if s.kind == OutputKind.USER_OUTPUT]
    order += [i for i, s in enumerate(sig.output_specs) if s.kind == OutputKind.USER_INPUT_MUTATION]
    specs = [sig.output_specs[i] for i in order]
    gm = ep.graph_module
    out_node = gm.graph.output_node()
    out_node.args = (tuple(out_node.args[0][i] for i in order),)
    gm.recompile()
    new_sig = ExportGraphSignature(
        input_specs=list(sig.input_specs),
        output_specs=[OutputSpec(OutputKind.USER_OUTPUT, s.arg, s.target) for s in specs],
    )
    calls = []
    for entry in ep.module_call_graph:
        if entry.fqn == "" and entry.signature is not None:
            old = entry.signature
            entry = ModuleCallEntry(
                "",
                ModuleCallSignature(
                    inputs=old.inputs,
                    outputs=old.outputs,  # names that survive a retrace; out_spec covers all
                    in_spec=old.in_spec,
                    out_spec=torch.utils._pytree.tree_flatten(tuple(range(len(specs))))[1],
                    forward_arg_names=old.forward_arg_names,
                ),
            )
        calls.append(entry)
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=new_sig,
        state_dict=ep.state_dict,
        range_constraints=ep.range_constraints,
        module_call_graph=calls,
        constants=ep.constants,
        verifiers=[ep.verifier],
    )


# ONNX translation of the plugin ops.

_SCHEMA_ATTR = {"int": int, "SymInt": int, "float": float, "str": str, "bool": int}


def _onnx_schema(name: str, inputs: list[str], attrs: dict[str, type], outputs: list[str]):
    import onnx

    ir_attr = {
        int: onnx.defs.OpSchema.AttrType.INT,
        float: onnx.defs.OpSchema.AttrType.FLOAT,
        str: onnx.defs.OpSchema.AttrType.STRING,
    }
    tensor_types = [
        t
        for t in onnx.defs.get_schema("Identity").type_constraints[0].allowed_type_strs
        if t.startswith("tensor(")
    ]
    return onnx.defs.OpSchema(
        name,
        PLUGIN_DOMAIN,
        PLUGIN_DOMAIN_VERSION,
        plugins.get(name).doc,
        inputs=[onnx.defs.OpSchema.FormalParameter(n, f"T_{n}") for n in inputs],
        outputs=[onnx.defs.OpSchema.FormalParameter(n, f"T_{n}") for n in outputs],
        type_constraints=[(f"T_{n}", tensor_types, "") for n in inputs + outputs],
        attributes=[onnx.defs.OpSchema.Attribute(n, ir_attr[t], "") for n, t in attrs.items()],
    )


def _translation(op: torch._ops.OpOverload, plugin: str, n_mutated: int = 0):
    """A function for torch.onnx's custom_translation_table: one `inkling.plugins::<plugin>` node.

    Tensor arguments (and SCALAR_INPUTS) are the node's inputs, the other arguments its attributes,
    plus `version` (and `weight_layout_version`)."""
    import onnxscript

    spec = plugins.get(plugin)
    schema_args = op._schema.arguments
    inputs = [a.name for a in schema_args if str(a.type) == "Tensor" or a.name in SCALAR_INPUTS]
    attrs = {a.name: _SCHEMA_ATTR[str(a.type)] for a in schema_args if a.name not in inputs}
    fixed = {"version": spec.version}
    if spec.weight_layout_version is not None:
        fixed["weight_layout_version"] = spec.weight_layout_version
    mutated = [schema_args[i].name for i in _mutated_args(plugins_op(plugin))]
    n_outs = len(op._schema.returns) - n_mutated
    outputs = [f"out{i}" for i in range(n_outs)] + [f"{m}_out" for m in mutated]
    schema = _onnx_schema(plugin, inputs, {**attrs, **{k: int for k in fixed}}, outputs)
    node_op = onnxscript.values.Op(
        onnxscript.values.Opset(PLUGIN_DOMAIN, PLUGIN_DOMAIN_VERSION), plugin, schema
    )

    params = [
        inspect.Parameter(
            a.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=a.default_value if a.has_default_value() else inspect.Parameter.empty,
        )
        for a in schema_args
    ]
    signature = inspect.Signature(params)

    def translate(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()  # a node leaves out the arguments it passes at their defaults (ep_size)
        kwargs = bound.arguments
        node_inputs = [kwargs[n] for n in inputs]
        node_attrs = {n: attrs[n](kwargs[n]) for n in attrs}
        return node_op(*node_inputs, **node_attrs, **fixed)

    translate.__signature__ = signature
    translate.__annotations__ = dict(attrs)
    translate.__name__ = translate.__qualname__ = plugin
    return translate


def plugins_op(name: str) -> torch._ops.OpOverload:
    return getattr(torch.ops.inkling, name).default


def translation_table(program: torch.export.ExportedProgram) -> dict:
    table = {}
    for node in program.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        ns, _, name = node.target._schema.name.partition("::")
        if node.target in table or ns not in (plugins.registry.NAMESPACE, TWIN_NAMESPACE):
            continue
        n_mutated = len(_mutated_args(plugins_op(name))) if ns == TWIN_NAMESPACE else 0
        table[node.target] = _translation(node.target, name, n_mutated)
    return table


# The export.

# Names of the step program's dynamic dims (builder/build.py `export_step`), found on these
# inputs; each KV cache's pool (one per cache kind) is num_blocks_<j>, found on key_caches_<j>.
STEP_DIMS = {
    ("input_ids", 0): "num_tokens",
    ("seq_lens", 0): "batch",
    ("logits_indices", 0): "num_logits",
    ("mm_embeds", 0): "num_mm",
    ("q_bound", 0): "max_seqlen_q",
}
OUTPUT_NAMES = {"step": ("logits", "hidden")}


def export_onnx(
    engine,
    path: str | os.PathLike,
    *,
    program: str = "step",
    weights: str = "inputs",
    optimize: bool = True,
    check: bool = True,
):
    """Write `engine.programs[program]` (an `Engine` or an engine directory) as ONNX to `path`.

    weights: "inputs" (graph inputs, the file holds no weights) or "external" (initializers in
    `<path>.data`). Returns the `onnx.ModelProto` as written (without external data loaded)."""
    import onnx
    from onnxscript import ir

    from .engine import Engine

    if weights not in ("inputs", "external"):
        raise ValueError(f"weights must be 'inputs' or 'external', got {weights!r}")
    if not isinstance(engine, Engine):
        engine = Engine.from_dir(engine, device="cpu")
    functional = functionalize(engine.programs[program])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onnx_program = torch.onnx.export(
            functional,
            dynamo=True,
            custom_translation_table=translation_table(functional),
            optimize=False,
            verbose=False,
        )
    model = onnx_program.model
    graph = model.graph

    # Output names: the program's outputs, then `<input>_out` for each updated cache/state.
    user_names = iter(OUTPUT_NAMES.get(program, ()))
    for value, spec in zip(graph.outputs, functional.graph_signature.output_specs, strict=True):
        value.name = f"{spec.target}_out" if spec.target else next(user_names, value.name)

    # Symbolic dims by their BuildConfig names (s48 -> num_tokens, s37 + 1 -> batch + 1, ...).
    inputs = {v.name: v for v in graph.inputs}
    rename = {}
    if program == "step":
        pools = {
            (n, 0): f"num_blocks_{n.rsplit('_', 1)[1]}" for n in inputs if re.fullmatch(r"key_caches_\d+", n)
        }
        for (name, axis), dim in {**STEP_DIMS, **pools}.items():
            sym = inputs[name].shape[axis] if name in inputs else None
            if isinstance(sym, ir.SymbolicDim) and sym.value:
                rename[sym.value] = dim
    if rename:
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, rename)) + r")\b")
        values = [
            *graph.inputs,
            *(o for node in ir.traversal.RecursiveGraphIterator(graph) for o in node.outputs),
        ]
        for value in values:
            if value.shape is not None and any(isinstance(d, ir.SymbolicDim) for d in value.shape):
                value.shape = ir.Shape(
                    [
                        ir.SymbolicDim(pattern.sub(lambda m: rename[m.group(1)], d.value))
                        if isinstance(d, ir.SymbolicDim) and d.value
                        else d
                        for d in value.shape
                    ]
                )

    if optimize:  # before the weights become initializers, so that nothing folds them
        onnx_program.optimize()
    model = onnx_program.model
    model.doc_string = (
        f"Inkling engine program {program!r}; plugin ops are nodes of the domain {PLUGIN_DOMAIN} "
        "(builder/onnx_export.py)"
    )
    model.metadata_props["inkling.engine_format_version"] = str(engine.config["version"])
    model.metadata_props["inkling.plugin_config"] = json.dumps(engine.config["plugin_config"])
    model.metadata_props["inkling.build_config"] = json.dumps(engine.config["build_config"])
    model.metadata_props["inkling.weights"] = weights
    model.opset_imports[PLUGIN_DOMAIN] = PLUGIN_DOMAIN_VERSION
    if weights == "external":
        from torch.onnx._internal.exporter._core import TorchTensor

        step_weights = engine.step_weights
        by_input = {"weights_" + re.sub(r"[^0-9a-zA-Z_]", "_", k): (k, t) for k, t in step_weights.items()}
        found = [v for v in model.graph.inputs if v.name in by_input]
        if len(by_input) != len(step_weights) or len(found) != len(step_weights):
            raise RuntimeError("the engine's weights do not match the graph's weight inputs one to one")
        for value in found:
            key, tensor = by_input[value.name]
            model.graph.inputs.remove(value)
            value.name = key
            value.const_value = TorchTensor(tensor.contiguous(), name=key)
            model.graph.register_initializer(value)

    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    onnx_program.save(path, external_data=weights == "external")
    if check:
        onnx.checker.check_model(path)
    return onnx.load(path, load_external_data=False)
