"""Dataset loader of the tiny_stories_cloze task: the jsonl next to this file, as a datasets DatasetDict."""

from pathlib import Path


def load(**kwargs):
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(Path(__file__).with_name("tiny_stories_cloze.jsonl"))})
