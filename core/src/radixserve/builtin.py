"""The core's own plugin: model architectures, quantization methods and the ``plugins`` /
``generate`` commands."""

from __future__ import annotations

from radixserve.hookspecs import hookimpl


@hookimpl
def register_model_architectures(register):
    from radixserve.models.deepseek import ARCHITECTURES as DEEPSEEK_ARCHITECTURES
    from radixserve.models.llama import ARCHITECTURES
    from radixserve.models.moe import ARCHITECTURES as MOE_ARCHITECTURES

    for name, cls in {**ARCHITECTURES, **MOE_ARCHITECTURES, **DEEPSEEK_ARCHITECTURES}.items():
        register(name, cls, description=cls.__doc__.splitlines()[0] if cls.__doc__ else "")


@hookimpl
def register_quantization_methods(register):
    from radixserve.quantization.methods import BUILTIN

    for name, (config_cls, probe, description) in BUILTIN.items():
        register(name, config_cls, probe=probe, description=description)


@hookimpl
def register_moe_a2a_backends(register):
    from radixserve.layers.moe import NoA2A

    register("none", NoA2A, description="single rank: every expert is local, dispatch and combine are the identity")


@hookimpl
def register_commands(register):
    from radixserve import cli

    register("plugins", cli.plugins_command, add_arguments=cli.plugins_arguments,
             description="list every plugin kind, name, package and availability")
    register("generate", cli.generate_command, add_arguments=cli.generate_arguments,
             description="generate a completion for a prompt with the offline engine")
