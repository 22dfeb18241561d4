# SPDX-License-Identifier: Apache-2.0
"""The experimental kernel variant, by name: what ``VLLM_MEGAKERNEL_VARIANTS``
selects for a served model (the build CLI has a flag for it). Off by
default; it becomes the default, or is deleted, once the GPU check has
timed it beside the default (docs/perf.md). One remains, with a measured
reason: ``wide_attn`` (ATTN read KV at 0.1 TB/s on the H200, 2026-11-30;
docs/design.md, "wide attention").

Variants are ``KernelShape`` flags: they change how instructions run, not
the program, so reference mode runs the same program with or without them.
The program variants the cost model decided are gone: QKV's head parts
became the default and the fused COMBINE was deleted, on the model's word
(docs/predictions.md). The legacy control and whole QKV heads are the GPU check's
comparison cases, set by build flags only.
"""

from __future__ import annotations

from dataclasses import dataclass

# KernelShape flags, as the build CLI names them with dashes.
KERNEL = ("wide_attn",)


@dataclass(frozen=True)
class Variants:
    names: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str, source: str = "VLLM_MEGAKERNEL_VARIANTS") -> Variants:
        """Comma-separated names; an unknown name is an error naming the
        known ones."""
        names = {n.strip() for n in text.split(",") if n.strip()}
        unknown = sorted(names - set(KERNEL))
        if unknown:
            raise ValueError(
                f"{source}: unknown variant {', '.join(map(repr, unknown))}; "
                f"choose from {', '.join(KERNEL)}"
            )
        return cls(frozenset(names))

    @classmethod
    def from_flags(cls, args) -> Variants:
        """The variants a command's ``--wide-attn``-style flags select
        (argparse attributes named as the variants)."""
        return cls(frozenset(n for n in KERNEL if getattr(args, n, False)))

    def kernel_flags(self) -> dict:
        """Keyword arguments of ``KernelShape.from_program``."""
        return {name: name in self.names for name in KERNEL}

    def __str__(self) -> str:
        return ",".join(n for n in KERNEL if n in self.names) or "none"
