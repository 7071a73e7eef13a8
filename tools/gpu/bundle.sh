#!/usr/bin/env bash
# The GPU kit's bundle: wheels of every llmtrain package and plugin, plus every third-party
# wheel the accelerator machine lacks (Python 3.12, manylinux x86_64), into one git-ignored folder
# that travels with the repo (`carry`). That machine has PyTorch, Triton and CUDA and no network,
# so torch is never bundled and everything else must be.
#
#   bash tools/gpu/bundle.sh [OUT]      # default OUT: .gpu-bundle in the repo's root
#
# Needs uv, a Python with pip (PYTHON, default python3) and the package index; see tools/README.md.
# The side-by-side's TorchTitan goes into OUT/torchtitan/: the anchor's files (TT_ANCHOR, default
# ../shared/torchtitan-anchor), its wheels (tools/gpu/torchtitan_wheels.txt) and its local corpus
# and tokenizer, made by the anchor's make_assets.py with TT_ASSETS_PYTHON (default: the nox
# integration venv's Python, which has tokenizers, numpy and torch: the corpus is their docstrings).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:-$ROOT/.gpu-bundle}"
PYTHON="${PYTHON:-python3}"
# the travelling limit is 64 MiB for the repo and what it carries; keep the bundle well under it
LIMIT_MIB="${LIMIT_MIB:-48}"
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux1_x86_64)

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
rm -rf "$OUT"
mkdir -p "$OUT"

# Plugins left out: their third-party stacks serve no GPU check and would not travel (wandb's
# wheel alone is ~20 MiB; lm-evaluation-harness brings datasets, evaluate, nltk, ...).
LEFT_OUT="llmtrain-lmeval llmtrain-wandb"

echo "== llmtrain wheels (every package, the meta-distribution, every plugin but: $LEFT_OUT)"
plugins=()
for dir in "$ROOT"/plugins/*/; do
    case " $LEFT_OUT " in *" $(basename "$dir") "*) continue ;; esac
    [ -f "$dir/pyproject.toml" ] && plugins+=("$dir")
done
"$PYTHON" -m pip wheel -q --no-deps -w "$OUT" "$ROOT"/packages/*/ "$ROOT" "${plugins[@]}"

echo "== resolving their dependencies for Python 3.12 manylinux x86_64"
# uv, not pip: an override with a marker that never holds takes torch and triton out of the
# resolution (the machine's own build stays; its CUDA wheels are not all on every index)
printf '%s\n' 'torch; sys_platform == "never"' 'triton; sys_platform == "never"' >"$WORK/overrides.txt"
grep -v "^torch==" "$ROOT/constraints.txt" >"$WORK/constraints.txt"
# the extras the GPU checks use: float8 (torchao) and the Hugging Face tokenizers
for wheel in "$OUT"/llmtrain*.whl; do
    name="$(basename "$wheel" | cut -d- -f1 | tr _ -)"
    case "$name" in
    llmtrain-parallel) echo "$name[float8]" ;;
    llmtrain-data-pack) echo "$name[hf]" ;;
    *) echo "$name" ;;
    esac
done >"$WORK/requirements.txt"
uv pip compile -q "$WORK/requirements.txt" --python-version 3.12 \
    --python-platform x86_64-manylinux_2_28 --only-binary :all: --find-links "$OUT" \
    --override "$WORK/overrides.txt" -c "$WORK/constraints.txt" \
    --no-header --annotation-style line -o "$WORK/compiled.txt"
"$PYTHON" "$ROOT/tools/gpu/missing.py" "$WORK/compiled.txt" >"$WORK/missing.txt"
echo "missing on the accelerator machine: $(tr '\n' ' ' <"$WORK/missing.txt")"

echo "== downloading them"
if [ -s "$WORK/missing.txt" ]; then
    "$PYTHON" -m pip download -q --no-deps "${TARGET[@]}" -d "$OUT" -r "$WORK/missing.txt"
fi

echo "== TorchTitan for the side-by-side"
ANCHOR="${TT_ANCHOR:-$ROOT/../shared/torchtitan-anchor}"
ASSETS_PYTHON="${TT_ASSETS_PYTHON:-$ROOT/.nox/integration/bin/python}"
[ -x "$ASSETS_PYTHON" ] || ASSETS_PYTHON="$PYTHON"
if [ -f "$ANCHOR/run_tt.sh" ]; then
    TT="$OUT/torchtitan"
    mkdir -p "$TT/wheels/fallback"
    # run_tt.sh and what it reads beside itself; cpu_smoke_train.py serves the dry run; the
    # README and NOTES say what the comparison does and does not make equal
    for file in run_tt.sh llama3_1b.toml tt_llama1b.py cpu_smoke_train.py README.md NOTES.md; do
        cp "$ANCHOR/$file" "$TT/"
    done
    pins="$ROOT/tools/gpu/torchtitan_wheels.txt"
    grep -v '^#' "$pins" | grep -v '^fallback/' | grep . >"$WORK/tt-wheels.txt"
    sed -n 's|^fallback/||p' "$pins" >"$WORK/tt-fallback.txt"
    "$PYTHON" -m pip download -q --no-deps "${TARGET[@]}" -d "$TT/wheels" -r "$WORK/tt-wheels.txt"
    "$PYTHON" -m pip download -q --no-deps "${TARGET[@]}" -d "$TT/wheels/fallback" \
        -r "$WORK/tt-fallback.txt"
    if ! "$ASSETS_PYTHON" -c "import tokenizers" 2>/dev/null; then
        echo "$ASSETS_PYTHON has no tokenizers: set TT_ASSETS_PYTHON to a Python with tokenizers" \
            "(and numpy and torch, for the corpus the anchor's NOTES describe)" >&2
        exit 1
    fi
    echo "making the corpus and tokenizer with $ASSETS_PYTHON (about a minute)"
    "$ASSETS_PYTHON" -W ignore "$ANCHOR/make_assets.py" --out "$TT" 2>"$WORK/assets.log" |
        tail -n 2 || { cat "$WORK/assets.log" >&2; exit 1; }
    "$PYTHON" "$ROOT/tools/gpu/side_by_side.py" check-torchtitan "$TT"
else
    echo "no TorchTitan anchor at $ANCHOR (TT_ANCHOR): the torchtitan steps will be skipped" >&2
fi

size_kib="$(du -sk "$OUT" | cut -f1)"
echo "== bundle: $OUT, $(ls "$OUT"/*.whl | wc -l) wheels, $((size_kib / 1024)) MiB"
ls -1 "$OUT"
[ -d "$OUT/torchtitan" ] && echo "torchtitan/: $(du -sh "$OUT/torchtitan" | cut -f1)"
if [ "$size_kib" -gt $((LIMIT_MIB * 1024)) ]; then
    echo "bundle is over $LIMIT_MIB MiB: it would not travel with the repo (64 MiB in all)" >&2
    exit 1
fi
