# SPDX-License-Identifier: Apache-2.0
"""The experimental kernel and program variants, by name: what
``VLLM_MEGAKERNEL_VARIANTS`` selects for a served model (the build CLI has a
flag for each). Off by default; one becomes the default once the GPU check
has shown it correct and faster (docs/perf.md). (QKV's head parts, the
``split_qkv`` variant until 2026-12-02, became the planner's default by
the cost model after thirteen sessions without a GPU: docs/design.md,
"QKV in head parts".)

Kernel variants are ``KernelShape`` flags: they change how instructions
run, not the program. Program variants are planner options: the program
changes, so the interpreter (reference mode) runs them too.
"""

from __future__ import annotations

from dataclasses import dataclass

# KernelShape flags, as the build CLI names them with dashes.
# legacy_control: the previous control (thread 0 waits, CTA barriers, direct
# GEMVs), kept for the side-by-side GPU comparison with the warp roles.
KERNEL = ("legacy_control", "wide_attn")
# Planner options: the fused COMBINE (isa.py, tail).
PROGRAM = ("fused_combine",)


@dataclass(frozen=True)
class Variants:
    names: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str, source: str = "VLLM_MEGAKERNEL_VARIANTS") -> Variants:
        """Comma-separated names; an unknown name is an error naming the
        known ones."""
        names = {n.strip() for n in text.split(",") if n.strip()}
        unknown = sorted(names - set(KERNEL) - set(PROGRAM))
        if unknown:
            raise ValueError(
                f"{source}: unknown variant {', '.join(map(repr, unknown))}; "
                f"choose from {', '.join(KERNEL + PROGRAM)}"
            )
        return cls(frozenset(names))

    @classmethod
    def from_flags(cls, args) -> Variants:
        """The variants a command's ``--legacy-control``-style flags select
        (argparse attributes named as the variants)."""
        return cls(frozenset(n for n in KERNEL + PROGRAM if getattr(args, n, False)))

    def plan_options(self) -> dict:
        """Keyword arguments of ``planner.plan``."""
        return {"fuse_combine": "fused_combine" in self.names}

    def kernel_flags(self) -> dict:
        """Keyword arguments of ``KernelShape.from_program``."""
        return {name: name in self.names for name in KERNEL}

    def __str__(self) -> str:
        return ",".join(n for n in KERNEL + PROGRAM if n in self.names) or "none"
