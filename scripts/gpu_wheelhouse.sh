#!/usr/bin/env bash
# The wheels ampsweep needs on the GPU machine (CPython 3.12, manylinux x86-64, no network
# there) beyond what its image already holds, downloaded here into .whl/ (git-ignored), with
# ampsweep itself as a wheel: scripts/gpu_day.sh installs them there offline.
#   scripts/gpu_wheelhouse.sh      # here, with network; run again, it reuses what .whl/ holds
# The set: ampsweep's requirements with the extras the GPU day runs (fp8: torchao; cluster:
# hydra-submitit-launcher, submitit), and theirs in turn, at the versions this checkout's .venv
# tests with, read from the .venv's installed metadata with the markers evaluated for CPython
# 3.12 on Linux. The walk stops at a package the image holds (IMAGE below): the image's build of
# it, and of what it needs, is what runs there. (pip's resolver is not used: this index serves
# no metadata files, so it would download torch and its CUDA libraries, gigabytes, to read
# their requirements.) A wheel of another version left from an earlier run is removed: two
# versions of one package stop an offline install. Fails past LIMIT_MIB: the working tree that
# travels to the machine holds 64 MiB in all.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
dest=.whl
LIMIT_MIB=60
EXTRAS=fp8,cluster

# The Python packages of the GPU machine's image (its H200 image's package list, as read there
# on 2026-11-17): never carried.
IMAGE="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl
meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"
# The image's versions that were read there: a carried package that needs another one fails here.
IMAGE_PINS="torch==2.11.0 torchvision==0.26.0 numpy==2.5.2 transformers==5.17.0 triton==3.6.0
safetensors==0.8.0 tokenizers==0.23.2 huggingface-hub==1.33.0"
# Published as source only (omegaconf 2.3 pins antlr4-python3-runtime 4.9.*, which has no wheel
# on PyPI): pure Python, so the wheel built here from its source installs there.
SOURCE_ONLY="antlr4-python3-runtime"

# CPython 3.12 on x86-64 Linux. pip takes a manylinux glibc level only when it is named, and
# prefers the first named: the oldest first, for the most portable build of each wheel.
platforms=(--platform manylinux2014_x86_64)
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
        "${platforms[@]}")

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$dest" "$tmp/src" "$tmp/self"

# ampsweep's wheel, built from a copy of the working tree (what travels to the machine), so
# that the build writes nothing into the checkout.
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -x -C "$tmp/src"
"$PY" -m pip wheel -q --no-deps -w "$tmp/self" "$tmp/src"
self_whl="$(ls "$tmp/self"/ampsweep-*.whl)"

# name==version of every package to carry, one a line; a requirement the .venv lacks (needed
# on 3.12 alone) as its requirement string, for pip to pick the newest that matches.
"$PY" - "$self_whl" "$EXTRAS" "$IMAGE" "$IMAGE_PINS" >"$tmp/wanted.txt" <<'EOF'
import re
import sys
import zipfile
from email.parser import Parser
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import Version

wheel, extras, image_names, image_pins = sys.argv[1:]
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def needs(requires, extras):
    """The requirements that apply on the target with these extras."""
    out = []
    for line in requires or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**ENV, "extra": e})
                                     for e in ("", *extras)):
            out.append(req)
    return out


image = {norm(n) for n in image_names.split()}
pins = {norm(p.split("==")[0]): Version(p.split("==")[1]) for p in image_pins.split()}
with zipfile.ZipFile(wheel) as z:
    meta = Parser().parsestr(z.read(next(n for n in z.namelist()
                                         if n.endswith(".dist-info/METADATA"))).decode())
queue = needs(meta.get_all("Requires-Dist"), extras.split(","))
carried, missing, problems = {}, {}, []
while queue:
    req = queue.pop()
    name = norm(req.name)
    if name in image:
        if name in pins and not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{req} excludes the image's {name} {pins[name]}")
        continue
    try:
        dist = metadata.distribution(req.name)
    except metadata.PackageNotFoundError:
        missing[name] = str(req).split(";")[0]
        continue
    if not req.specifier.contains(dist.version, prereleases=True):
        problems.append(f"{req} excludes the .venv's {name} {dist.version}")
    if name not in carried:
        carried[name] = (dist.version, set(req.extras))
        queue.extend(needs(dist.requires, sorted(req.extras)))
    elif set(req.extras) - carried[name][1]:  # the same package, asked with more extras
        carried[name][1].update(req.extras)
        queue.extend(needs(dist.requires, sorted(carried[name][1])))
if problems:
    sys.exit("gpu_wheelhouse: error: " + "; ".join(problems))
for name, (version, _) in sorted(carried.items()):
    print(f"{name}=={version}")
for name, spec in sorted(missing.items()):
    print(spec)
EOF

echo "gpu_wheelhouse: $(wc -l <"$tmp/wanted.txt") packages beyond the image, into $dest/"
grep -v -i -E "^($(echo $SOURCE_ONLY | tr ' ' '|'))([=<>!~ ]|$)" "$tmp/wanted.txt" \
  >"$tmp/download.txt" || true
# --no-deps: the set is complete; pip skips a file already in $dest.
"$PY" -m pip download -q --no-deps "${target[@]}" -d "$dest" -r "$tmp/download.txt"
for name in $SOURCE_ONLY; do
  pin="$(grep -i -E "^$name([=<>!~ ]|$)" "$tmp/wanted.txt" || true)"
  [ -z "$pin" ] || [ -n "$(find "$dest" -maxdepth 1 -iname "${name//-/_}-${pin#*==}-*.whl")" ] \
    || "$PY" -m pip wheel -q --no-deps --no-binary "$name" -w "$dest" "$pin"
done
rm -f "$dest"/ampsweep-*.whl
cp "$self_whl" "$dest/"

# Drop what is not in the set (another version, a package no longer needed).
"$PY" - "$dest" "$tmp/wanted.txt" "$(basename "$self_whl")" <<'EOF'
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


folder, keep = Path(sys.argv[1]), sys.argv[3]
wanted = {}
for line in Path(sys.argv[2]).read_text().split():
    req = Requirement(line)
    wanted[norm(req.name)] = req.specifier
have = set()
for wheel in sorted(folder.glob("*.whl")):
    name, version = norm(wheel.name.split("-")[0]), wheel.name.split("-")[1]
    if wheel.name == keep:
        continue
    if name in wanted and wanted[name].contains(version, prereleases=True) and name not in have:
        have.add(name)
        continue
    print(f"gpu_wheelhouse: removing {wheel.name} (not in the set)")
    wheel.unlink()
if set(wanted) - have:
    sys.exit(f"gpu_wheelhouse: error: no wheel for {sorted(set(wanted) - have)}")
EOF

bytes="$(du -cb "$dest"/*.whl | tail -1 | cut -f1)"
mib="$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')"
count="$(ls "$dest"/*.whl | wc -l)"
if [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu_wheelhouse: error: $dest/ holds $count wheels, $mib MiB, over $LIMIT_MIB MiB: the" \
       "working tree that travels to the GPU machine holds 64 MiB in all" >&2
  ls -S -l "$dest" | head -n 8 >&2
  exit 1
fi
echo "gpu_wheelhouse: $dest/ holds $count wheels, $mib MiB (under $LIMIT_MIB MiB); on the GPU" \
     "machine: scripts/gpu_day.sh"
