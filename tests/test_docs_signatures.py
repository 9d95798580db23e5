"""docs/optimizers.md's signatures are the classes' (scripts/docs_signatures.py writes them; the docs'
build renders them too, and warns when the page's source is stale)."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "docs_signatures.py"
_spec = importlib.util.spec_from_file_location("docs_signatures", SCRIPT)
docs_signatures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_signatures)


def test_the_optimizers_page_shows_each_optimizer_s_signature_as_the_class_has_it():
    stale = docs_signatures.stale(docs_signatures.PAGE.read_text())
    assert not stale, (f"docs/optimizers.md: the signatures of {', '.join(stale)} differ from the classes' "
                       "(or are missing): run .venv/bin/python scripts/docs_signatures.py")


def test_a_drifted_signature_is_found_and_rewritten():
    """A span that lost parameters (Adan's, as it once lacked master_bits .. shard_group) is stale, and
    rendering restores it without touching the prose around it."""
    text = "- **`fastoptim.Adan(params, lr=1e-3)`** computes what the\n  official sail-sg/Adan computes.\n"
    assert "Adan" in docs_signatures.stale(text)
    rendered = docs_signatures.render(text)
    assert "master_bits=16" in rendered and "shard_group=None)`**" in rendered
    assert rendered.endswith("`**\n  computes what the\n  official sail-sg/Adan computes.\n")
    assert docs_signatures.render(rendered) == rendered
    assert max(len(line) for line in rendered.splitlines()) <= docs_signatures.WIDTH


def test_defaults_are_written_as_the_docs_write_them():
    assert [docs_signatures._value(v) for v in (1e-3, 1e-8, 0.95, 0.0, (0.9, 0.999), None, 3)] == [
        "1e-3", "1e-8", "0.95", "0.0", "(0.9, 0.999)", "None", "3"]
