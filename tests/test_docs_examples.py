"""Every example in README.md, docs/api.md and docs/integrations.md runs as pasted, against one real
server on loopback that preloads the models which serve offline (MiniLM, MPNet, splade-tiny, the
Rampart PII tagger).

Each ```python block is one test, run as a script in a fresh interpreter (in a temporary working
folder, with HF_HUB_OFFLINE=1 and Chroma's and Haystack's telemetry off), and must exit 0. Each
```bash block whose commands are all `curl` calls is one test too, run by bash with a `.curlrc`
that adds `--fail-with-body` (an HTTP error exits non-zero), and must print JSON. Other bash blocks
(make, pip, the batch CLI over files) are not collected. The only change made to a block is its
base URL: the docs' `http://127.0.0.1:8080` and `localhost:8080` become the test server's URL.

A block that cannot run here (a model whose weights do not ship on PyPI, image files) says so in
the markdown, in an HTML comment on the line before its fence:
`<!-- docs-test: skip (needs openai/clip-vit-base-patch32's weights) -->`; its test skips with that
reason. The skipped blocks that name CLIP still run once more, against a tiny random-weight CLIP
(tests/vision_models.py) served under that name, with noise images at the paths they read: that
proves their code (imports, names, calls), not what a real CLIP answers. A fence that is not meant
to run (a signature, a response) is not ```python or ```bash. Test ids name the file and the
fence's line: `README.md:L95`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import MODEL_ID

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/api.md", "docs/integrations.md")
# The models the examples name that serve offline; the server is ready once all are warm.
PRELOAD = (
    MODEL_ID,
    "sentence-transformers/all-mpnet-base-v2",
    "rasyosef/splade-tiny",
    "arcjet/sensitive-info-rampart",
)
CLIP = "openai/clip-vit-base-patch32"
# The files the image examples read, relative to their working folder.
IMAGE_FILES = ("cat.jpg", "dog.png", "photos/cat.jpg", "photos/dog.png")
DOCS_URL = re.compile(r"(?:http://)?(?:127\.0\.0\.1|localhost):8080")
SKIP_MARKER = re.compile(r"<!--\s*docs-test:\s*skip\s*\((.+)\)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
BLOCK_TIMEOUT_S = 180


@dataclass(frozen=True)
class Block:
    name: str  # "README.md:L95", the fence's opening line
    language: str  # "python" or "bash"
    code: str
    skip_reason: str | None


def is_curl_block(code: str) -> bool:
    """Every command of the block is a `curl` call: with single-quoted strings (a JSON body over
    several lines) and backslash continuations folded away, each line left starts with `curl `."""
    folded = re.sub(r"'[^']*'", "''", code).replace("\\\n", " ")
    commands = [line.strip() for line in folded.splitlines() if line.strip() and not line.strip().startswith("#")]
    return bool(commands) and all(command.startswith("curl ") for command in commands)


def doc_blocks(relative: str) -> list[Block]:
    """The ```python blocks and curl-only ```bash blocks of one markdown file, in order."""
    lines = (ROOT / relative).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        code = "\n".join(lines[i + 1 : end]) + "\n"
        language = opening.group(1)
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP_MARKER.search(previous)
        if language == "python" or (language == "bash" and is_curl_block(code)):
            blocks.append(Block(f"{relative}:L{i + 1}", language, code, marker.group(1) if marker else None))
        i = end + 1
    return blocks


BLOCKS = [block for relative in DOCS for block in doc_blocks(relative)]
CLIP_BLOCKS = [block for block in BLOCKS if block.skip_reason is not None and CLIP in block.code]


@pytest.fixture(scope="module")
def docs_server(serve) -> str:
    return serve(preload=PRELOAD)


@pytest.fixture(scope="module")
def clip_server(serve, tmp_path_factory) -> str:
    """A server of a tiny random-weight CLIP whose card takes the id of the docs' CLIP."""
    pytest.importorskip("transformers")
    from vision_models import tiny_clip

    directory, cards = tmp_path_factory.mktemp("docs-clip"), tmp_path_factory.mktemp("docs-clip-cards")
    card = tiny_clip(directory, model_id=CLIP, words=["a", "photo", "of", "cat", "dog", "car"], extract=True).card
    (cards / "clip.yaml").write_text(json.dumps(card))  # JSON is YAML
    return serve(preload=(CLIP,), cards_dirs=(cards,), models=(CLIP,))


def run_block(block: Block, url: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    code = DOCS_URL.sub(url, block.code)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "ANONYMIZED_TELEMETRY": "False",  # chromadb
        "HAYSTACK_TELEMETRY_ENABLED": "False",
        "CURL_HOME": str(workdir),
    }
    if block.language == "python":
        script = workdir / "example.py"
        script.write_text(code)
        command = [sys.executable, str(script)]
    else:
        (workdir / ".curlrc").write_text("fail-with-body\nshow-error\nmax-time = 120\n")
        command = ["bash", "-euo", "pipefail", "-c", code]
    return subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, check=False
    )


def test_the_docs_have_examples_to_run_and_every_python_one_compiles() -> None:
    """The extraction finds the blocks (a changed fence style would silently collect nothing), and
    a skipped block is still whole Python."""
    names = {block.name.split(":")[0] for block in BLOCKS}
    assert names == set(DOCS), names
    assert sum(block.language == "bash" for block in BLOCKS) >= 3
    for block in BLOCKS:
        if block.language == "python":
            compile(block.code, block.name, "exec")


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_doc_example_runs_as_pasted_against_a_real_server(block: Block, docs_server: str, tmp_path: Path) -> None:
    if block.skip_reason is not None:
        pytest.skip(block.skip_reason)
    done = run_block(block, docs_server, tmp_path)
    assert done.returncode == 0, f"{block.name} exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    if block.language == "bash":
        json.loads(done.stdout)  # what curl printed is the server's JSON answer


@pytest.mark.parametrize("block", CLIP_BLOCKS, ids=[block.name for block in CLIP_BLOCKS])
def test_skipped_image_example_runs_against_a_random_weight_clip_under_the_docs_name(
    block: Block, clip_server: str, tmp_path: Path
) -> None:
    import numpy as np
    from PIL import Image as PILImage

    rng = np.random.default_rng(0)
    for name in IMAGE_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        PILImage.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(tmp_path / name)
    done = run_block(block, clip_server, tmp_path)
    assert done.returncode == 0, f"{block.name} exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
