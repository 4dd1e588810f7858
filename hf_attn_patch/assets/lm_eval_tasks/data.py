"""Loaders of the offline zero-shot tasks (the YAMLs next to this file): lm-eval imports this file by its path."""

from hf_attn_patch.evaluation.harness import load_offline


def hellaswag(**kwargs):
    return load_offline("hellaswag_offline")


def arc_easy(**kwargs):
    return load_offline("arc_easy_offline")


def arc_challenge(**kwargs):
    return load_offline("arc_challenge_offline")


def piqa(**kwargs):
    return load_offline("piqa_offline")


def winogrande(**kwargs):
    return load_offline("winogrande_offline")


def winogrande_text(doc):  # lm-eval's winogrande: the context is each option put in the blank...
    return {"1": 0, "2": 1}[doc["answer"]]


def winogrande_target(doc):  # ... and the continuation, the rest of the sentence, is scored
    return doc["sentence"][doc["sentence"].index("_") + 1 :].strip()


def winogrande_choices(doc):
    blank = doc["sentence"].index("_")
    return [doc["sentence"][:blank] + option for option in (doc["option1"], doc["option2"])]
