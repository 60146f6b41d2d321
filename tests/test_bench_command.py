"""`mmgen bench` runs the repository's harness (`benchmarks/bench.py`), which the installed
package does not ship: building the parser imports neither it nor a pipeline, an editable
install finds it in its checkout from any folder, and without it the command is one line."""

import subprocess
import sys
from pathlib import Path

from mmgen.cli import main

ROOT = Path(__file__).parents[1]


def test_building_the_parser_imports_no_pipeline_and_no_benchmark_code():
    probe = ("import sys, mmgen.cli\n"
             "mmgen.cli.build_parser()\n"
             "print(sorted(m for m in sys.modules if m.startswith(('benchmarks', 'mmgen.image_ar.llamagen', "
             "'mmgen.image_ar.var', 'mmgen.image_ar.mar', 'mmgen.image_ar.janus'))))\n")
    # From the repository root, where `benchmarks` is importable: the parser still leaves it alone.
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_harness_is_found_in_the_checkout_from_another_folder(tmp_path):
    probe = "import mmgen.image_ar.cli as cli; print(cli.bench_harness().__file__)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == ROOT / "benchmarks" / "bench.py"


def test_without_the_harness_the_command_is_one_line(monkeypatch, capsys, tmp_path):
    import mmgen.image_ar.cli as cli

    # An installed wheel: no `benchmarks` to import, and site-packages holds no checkout.
    monkeypatch.setitem(sys.modules, "benchmarks", None)
    monkeypatch.setitem(sys.modules, "benchmarks.bench", None)
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "mmgen" / "image_ar" / "cli.py"))
    assert main(["bench", "--batch-sizes", "1", "--repeats", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("mmgen: error: mmgen bench runs the benchmark harness of a source checkout")
