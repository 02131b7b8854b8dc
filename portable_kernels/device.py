"""The device model: what a backend tells the core about a device.

A :class:`DeviceInfo` is a frozen value built by a backend's ``pk_detect_device`` hook. The
core never looks at vendor strings; variants state what they need as *capabilities*, words
from the one vocabulary below. A plugin that needs a new word calls
:func:`register_capability` with a definition, so that a typo in a variant's ``requires``
is an error instead of a variant that silently never runs.

Emulation (``PK_EMULATE=<profile>`` or ``pk.emulate``, in ``dispatch``) makes detection report a profile's
``DeviceInfo`` (an H100, an MI300X, an Iluvatar BI-150, ...) so that *selection* can be
tested on any machine. Kernels still execute on the real device; calling a variant the real
device cannot execute raises ``VariantUnavailableError`` rather than running another.
"""
from __future__ import annotations

import dataclasses

__all__ = [
    "CAPABILITIES",
    "DeviceInfo",
    "register_capability",
]

#: The capability vocabulary. A variant's ``requires`` and a device's ``capabilities`` are
#: drawn from these words (and from words plugins add with :func:`register_capability`).
CAPABILITIES: dict[str, str] = {
    "interpreter": "kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1), not compiled",
    "mma": "tensor-core / matrix-core dots (tl.dot lowers to MMA instructions)",
    "wgmma": "Hopper warpgroup MMA (asynchronous, operands in shared memory)",
    "tcgen05": "Blackwell fifth-generation tensor cores (tcgen05.mma, accumulators in tensor memory)",
    "tensor_descriptor": "TMA-style tensor descriptors: tl.make_tensor_descriptor and host "
    "TensorDescriptor, loaded by a copy engine",
    "warp_specialize": "tl.range(..., warp_specialize=True): producer/consumer warp groups",
    "bf16": "bfloat16 tensors can be loaded, stored and converted",
    "fp8": "float8 dots in the OCP formats (float8_e4m3fn, float8_e5m2)",
    "fp8_fnuz": "float8 dots in the fnuz formats (float8_e4m3fnuz, float8_e5m2fnuz: no negative "
    "zero, one NaN, bias 8/16), as on AMD CDNA3",
    "fp64": "float64 arithmetic",
    "atomics": "global-memory atomics including atomic_cas/atomic_xchg spin locks",
    "libdevice": "triton.language.extra.libdevice math functions",
    "wave64": "64-lane warps (wavefronts): block shapes and num_warps must account for it",
}


def register_capability(word: str, meaning: str) -> None:
    """Add a capability word to the vocabulary (for plugins with features of their own).

    Args:
        word: lower-case identifier, e.g. ``"acme_sparse_mma"``; prefix it with the vendor.
        meaning: one sentence a reader of ``portable-kernels info`` will see.
    """
    if not word.isidentifier() or word.lower() != word:
        raise ValueError(f"capability {word!r} must be a lower-case identifier")
    existing = CAPABILITIES.get(word)
    if existing is not None and existing != meaning:
        raise ValueError(f"capability {word!r} is already defined as {existing!r}")
    CAPABILITIES[word] = meaning


def check_capabilities(words: frozenset[str], what: str) -> None:
    """Raise ``ValueError`` naming any word not in the vocabulary."""
    unknown = sorted(set(words) - CAPABILITIES.keys())
    if unknown:
        raise ValueError(
            f"{what}: unknown capabilities {unknown}; known: {sorted(CAPABILITIES)} "
            "(plugins add words with portable_kernels.register_capability)"
        )


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What the core knows about one device. Built by a backend's ``pk_detect_device``.

    Attributes:
        vendor: ``"nvidia"``, ``"amd"``, ``"iluvatar"``, ``"cpu"`` or a plugin's own name.
        arch: the architecture, e.g. ``"sm_90"``, ``"gfx942"``, ``"ivcore11"``, ``"interpreter"``.
        name: the device's marketing name, e.g. ``"NVIDIA H200"``.
        warp_size: threads per warp / wavefront (32 on NVIDIA, 64 on CDNA and CoreX).
        num_sms: streaming multiprocessors / compute units (programs of a persistent grid).
        shared_memory: bytes of shared memory one program may use (0 where not applicable).
        triton_version: the Triton version that compiles (or interprets) kernels.
        capabilities: words from :data:`CAPABILITIES`.
        backend: the plugin that detected the device.
        emulated: the profile name when this info comes from emulation, else ``None``.
        evidence: what the backend's kernels have been through on this architecture, in
            one line: starting ``"run: "`` where its tests executed on such a device, else
            what was done instead (``"compiled for gfx942 (ci/compile_matrix.py), not
            run"``), so that no one mistakes a compile check for a test. Shown by
            ``explain``, ``info`` and conformance reports; ``""`` says nothing.
    """

    vendor: str
    arch: str
    name: str
    warp_size: int
    num_sms: int
    shared_memory: int
    triton_version: str
    capabilities: frozenset[str]
    backend: str = ""
    emulated: str | None = None
    evidence: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))
        check_capabilities(self.capabilities, f"DeviceInfo({self.vendor}, {self.arch})")

    @property
    def fingerprint(self) -> str:
        """A stable string naming this kind of device and toolchain (cache keys, reports)."""
        name = self.name.replace(" ", "_")
        return f"{self.vendor}-{self.arch}-{name}-{self.num_sms}sm-triton{self.triton_version}"

    @property
    def max_warps(self) -> int:
        """The most warps a program may have: warps x lanes stays within 1024 threads (so
        16 on 64-lane devices; a kernel past it fails to launch or to compile)."""
        return max(1, 1024 // max(self.warp_size, 1))

    @property
    def has_run(self) -> bool:
        """True where the backend says its kernels have executed on this architecture
        (``evidence`` starts with ``"run: "``); False where it says they have not, or
        says nothing."""
        return self.evidence.startswith("run: ")

    def has(self, *capabilities: str) -> bool:
        """True when the device has every capability named."""
        return all(c in self.capabilities for c in capabilities)

    def to_dict(self) -> dict:
        """A JSON-friendly dict (capabilities sorted)."""
        d = dataclasses.asdict(self)
        d["capabilities"] = sorted(self.capabilities)
        d["fingerprint"] = self.fingerprint
        return d
