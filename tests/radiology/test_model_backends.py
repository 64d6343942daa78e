"""Model backends (CheXbert, RaTE-NER / RaTEScore, RadGraph) on tiny models of the same architectures.

Every model here is built by the test itself, with random or hand-set weights, and
loaded back from a temporary directory through the backend's own loading code.
"""

from __future__ import annotations

import json
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from grouprl.domains.radiology.rewards import backends  # noqa: E402
from grouprl.domains.radiology.rewards.chexpert import OBSERVATIONS  # noqa: E402
from grouprl.domains.radiology.rewards.components import COMPONENTS, score_components  # noqa: E402
from grouprl.domains.radiology.rewards.entities import ReportGraph, split_sentences  # noqa: E402
from grouprl.domains.radiology.rewards.radgraph_f1 import radgraph_scores  # noqa: E402
from grouprl.domains.radiology.rewards.ratescore import RateEntity, rate_entities, ratescore  # noqa: E402

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("small left pleural eff ##usion no pneumothorax heart size is normal bilateral consolidation "
         "the lungs are clear . , there a mild").split()


def save_wordpiece_tokenizer(path, words=WORDS):
    """A BERT-style uncased WordPiece tokenizer over ``words``, saved as a BertTokenizerFast directory."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + list(words))}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    fast = BertTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                             sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(str(path))
    return vocab


def tiny_bert_config(vocab_size, **kwargs):
    from transformers import BertConfig

    defaults = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=64)
    return BertConfig(**{**defaults, **kwargs})


@pytest.fixture
def restore_components():
    before = dict(COMPONENTS)
    yield
    COMPONENTS.clear()
    COMPONENTS.update(before)


def test_backends_package_is_light():
    import subprocess

    code = ("import sys; import grouprl.domains.radiology.rewards.backends as b; "
            "print('torch' in sys.modules, sorted(m for m in sys.modules if m.startswith(b.__name__ + '.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "[]"]
    assert backends.CheXbertLabeler.__module__.endswith("backends.chexbert")  # lazily imported on use
    with pytest.raises(AttributeError):
        backends.NoSuchBackend


# ============================================================================ CheXbert
HEAD_ORDER = ["Enlarged Cardiomediastinum", "Cardiomegaly", "Lung Opacity", "Lung Lesion", "Edema", "Consolidation",
              "Pneumonia", "Atelectasis", "Pneumothorax", "Pleural Effusion", "Pleural Other", "Fracture",
              "Support Devices", "No Finding"]
# The class each head is forced to output, and the grouprl label that class means.
FORCED = [0, 1, 2, 3, 1, 2, 3, 0, 2, 1, 0, 3, 1, 1]
MEANING = {0: None, 1: 1, 2: 0, 3: -1}


class _TestCheXbert(torch.nn.Module):
    """CheXbert's published layout, written independently of the backend: bert, dropout, 14 heads."""

    def __init__(self, config):
        super().__init__()
        from transformers import BertModel

        self.bert = BertModel(config)
        self.dropout = torch.nn.Dropout(0.1)
        self.linear_heads = torch.nn.ModuleList([torch.nn.Linear(config.hidden_size, 4) for _ in range(13)]
                                                + [torch.nn.Linear(config.hidden_size, 2)])


class _NotATensor:
    pass


@pytest.fixture(scope="module")
def chexbert_files(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("chexbert")
    tok_dir = root / "bert-base-uncased"
    vocab = save_wordpiece_tokenizer(tok_dir)
    config = tiny_bert_config(len(vocab))
    config.save_pretrained(str(tok_dir))  # a local bert-base-uncased directory carries its config.json
    model = _TestCheXbert(config).eval()
    with torch.no_grad():
        for head, cls in zip(model.linear_heads, FORCED):
            head.weight.zero_()
            head.bias.fill_(-5.0)
            head.bias[cls] = 5.0
    state = model.state_dict()
    # As published: torch.save of a DataParallel model's state under model_state_dict, with the optimizer's.
    pth = root / "chexbert.pth"
    torch.save({"epoch": 7, "model_state_dict": {f"module.{k}": v for k, v in state.items()},
                "optimizer_state_dict": {"state": {}, "param_groups": [{"lr": 2e-5, "params": [0, 1]}]}}, pth)
    from safetensors.torch import save_file

    st = root / "chexbert.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(st))
    return {"root": root, "tok": tok_dir, "pth": pth, "st": st, "model": model, "state": state}


def test_chexbert_labels_follow_the_heads_argmax(chexbert_files):
    from grouprl.domains.radiology.rewards.backends.chexbert import CheXbertLabeler

    labeler = CheXbertLabeler(chexbert_files["pth"], tokenizer_path=chexbert_files["tok"])
    texts = ["Small left pleural effusion.", "Heart size is normal.\nThe lungs are clear.", "", "  \n"]
    labels = labeler.label_reports(texts)
    expected = {name: MEANING[cls] for name, cls in zip(HEAD_ORDER, FORCED)}
    assert expected["No Finding"] == 1 and expected["Lung Opacity"] == 0 and expected["Lung Lesion"] == -1
    assert expected["Enlarged Cardiomediastinum"] is None
    for found in labels[:2]:
        assert list(found) == list(OBSERVATIONS)  # grouprl's naming and order
        assert found == expected
    assert labels[2] == labels[3] == dict.fromkeys(OBSERVATIONS)  # a blank text is not a report
    assert labeler.label_report("Small left pleural effusion.") == expected
    assert labeler.backend == f"labeler=chexbert:{chexbert_files['pth']}"


def test_chexbert_no_finding_head_is_two_class(chexbert_files, tmp_path):
    from grouprl.domains.radiology.rewards.backends.chexbert import CheXbertLabeler

    state = dict(chexbert_files["state"])
    bias = torch.tensor([3.0, -3.0])  # No Finding: blank wins
    state["linear_heads.13.bias"] = bias
    path = tmp_path / "blank_no_finding.pth"
    torch.save(state, path)  # a bare state dict, no module. prefix, no wrapper
    labels = CheXbertLabeler(path, tokenizer_path=chexbert_files["tok"]).label_reports(["Heart size is normal."])[0]
    assert labels["No Finding"] is None
    assert labels["Cardiomegaly"] == 1


def test_chexbert_embed_is_the_cls_state_and_safetensors_match(chexbert_files):
    from transformers import BertTokenizerFast

    from grouprl.domains.radiology.rewards.backends.chexbert import CheXbertLabeler

    texts = ["Small left pleural effusion.", "", "Heart   size is\nnormal."]
    from_pth = CheXbertLabeler(chexbert_files["pth"], tokenizer_path=chexbert_files["tok"], batch_size=2)
    from_st = CheXbertLabeler(chexbert_files["st"], tokenizer_path=chexbert_files["tok"])
    emb = from_pth.embed(texts)
    assert emb.shape == (3, 32) and emb.dtype == torch.float32
    assert torch.equal(emb[1], torch.zeros(32))
    tokenizer = BertTokenizerFast.from_pretrained(str(chexbert_files["tok"]))
    model = chexbert_files["model"]
    with torch.no_grad():
        for row, text in ((0, texts[0]), (2, "Heart size is normal.")):
            enc = tokenizer(text, return_tensors="pt")
            ids = enc["input_ids"][0]
            assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
            cls = model.bert(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])[0][0, 0]
            assert torch.allclose(emb[row], cls, atol=1e-5)
    assert torch.allclose(from_st.embed(texts), emb, atol=1e-6)
    assert from_st.label_reports(texts) == from_pth.label_reports(texts)
    sims = from_pth.similarity(["Small left pleural effusion.", ""], ["Small left pleural effusion.", "Heart."])
    assert sims[0] == pytest.approx(1.0, abs=1e-5) and sims[1] == 0.0


def test_chexbert_missing_heads_named(chexbert_files, tmp_path):
    from grouprl.domains.radiology.rewards.backends.chexbert import CheXbertLabeler

    state = {k: v for k, v in chexbert_files["state"].items()
             if not k.startswith("linear_heads.13.") and k != "linear_heads.5.weight"}
    path = tmp_path / "broken.pth"
    torch.save({"model_state_dict": {f"module.{k}": v for k, v in state.items()}}, path)
    with pytest.raises(ValueError) as info:
        CheXbertLabeler(path, tokenizer_path=chexbert_files["tok"])
    message = str(info.value)
    for key in ("linear_heads.13.weight", "linear_heads.13.bias", "linear_heads.5.weight"):
        assert key in message
    assert "missing 3 keys" in message and "linear_heads.5.bias" not in message

    wrong = dict(chexbert_files["state"])
    wrong["linear_heads.13.weight"] = torch.zeros(4, 32)  # a four-class No Finding head
    wrong["linear_heads.13.bias"] = torch.zeros(4)
    path = tmp_path / "wrong_shape.safetensors"
    from safetensors.torch import save_file

    save_file(wrong, str(path))
    with pytest.raises(ValueError, match=r"linear_heads\.13\.weight has shape \(4, 32\), expected \(2, 32\)"):
        CheXbertLabeler(path, tokenizer_path=chexbert_files["tok"])


def test_chexbert_never_unpickles_objects(chexbert_files, tmp_path):
    from grouprl.domains.radiology.rewards.backends.chexbert import CheXbertLabeler

    path = tmp_path / "objects.pth"
    torch.save({"model_state_dict": dict(chexbert_files["state"]), "extra": _NotATensor()}, path)
    with pytest.raises(ValueError, match="weights_only=True"):
        CheXbertLabeler(path, tokenizer_path=chexbert_files["tok"])


def test_chexbert_attention_heads_from_argument_when_no_config(chexbert_files, tmp_path):
    from grouprl.domains.radiology.rewards.backends.chexbert import CheXbertLabeler

    tok_dir = tmp_path / "vocab_only"
    save_wordpiece_tokenizer(tok_dir)  # no config.json, hidden size 32 is no multiple of 64
    with pytest.raises(ValueError, match="num_attention_heads"):
        CheXbertLabeler(chexbert_files["st"], tokenizer_path=tok_dir)
    labeler = CheXbertLabeler(chexbert_files["st"], tokenizer_path=tok_dir, num_attention_heads=2)
    assert labeler.embed(["Heart size is normal."]).shape == (1, 32)
    with pytest.raises(FileNotFoundError):
        CheXbertLabeler(tmp_path / "nope.pth", tokenizer_path=tok_dir)


def test_chexbert_components(chexbert_files, restore_components, tmp_path):
    from grouprl.domains.radiology.rewards.backends.chexbert import register_chexbert_components

    registered = register_chexbert_components(chexbert_files["pth"], chexbert_files["tok"])
    assert [c.name for c in registered] == ["chexbert14micro", "chexbert5micro", "chexbert_bal_acc"]
    for component in registered:
        assert component.backend == f"labeler=chexbert:{chexbert_files['pth']}"
        assert COMPONENTS[component.name] is component
    # Every report gets the forced labels, so equal pairs agree; a blank hypothesis has no positive.
    hyps = ["Small left pleural effusion.", ""]
    refs = ["Heart size is normal.", "Heart size is normal."]
    out = score_components(hyps, refs, ["chexbert14micro", "chexbert5micro", "chexbert_bal_acc"])
    assert out["chexbert14micro"] == [1.0, 0.0]
    # The five: Cardiomegaly 1, Edema 1, Consolidation 0, Atelectasis None, Pleural Effusion 1 -> positives.
    assert out["chexbert5micro"] == [1.0, 0.0]
    assert out["chexbert_bal_acc"] == [1.0, 0.5]  # blank hyp: recall of positives 0, of negatives 1
    assert register_chexbert_components(chexbert_files["pth"], chexbert_files["tok"])[0] is registered[0]
    with pytest.raises(ValueError, match="already registered"):
        register_chexbert_components(chexbert_files["st"], chexbert_files["tok"])
    swapped = register_chexbert_components(chexbert_files["st"], chexbert_files["tok"], replace=True)
    assert swapped[0].backend == f"labeler=chexbert:{chexbert_files['st']}"


def test_chexbert_corpus_f1_says_its_backend(chexbert_files):
    from grouprl.domains.radiology.rewards.backends.chexbert import load_chexbert

    labeler = load_chexbert(chexbert_files["pth"], tokenizer_path=chexbert_files["tok"])
    assert load_chexbert(chexbert_files["pth"], tokenizer_path=chexbert_files["tok"]) is labeler
    out = labeler.corpus_f1(["Small left pleural effusion."], ["Heart size is normal."])
    assert out["backend"] == labeler.backend and out["micro_f1_14"] == 1.0


# ============================================================================ RaTE-NER
from grouprl.domains.radiology.rewards.backends.rate_ner import RATE_NER_LABELS, decode_bio  # noqa: E402

# The tag each token (its first word piece, for a word) is built to get; "##usion" is tagged
# differently to show that only a word's first piece counts.
TOKEN_TAGS = {
    "small": "B-ABNORMALITY", "left": "B-ANATOMY", "pleural": "I-ANATOMY", "eff": "B-ABNORMALITY",
    "##usion": "O", "no": "O", "pneumothorax": "B-NON-ABNORMALITY", "heart": "B-ANATOMY", "size": "O",
    "is": "O", "normal": "B-NON-ABNORMALITY", "bilateral": "I-DISEASE", "consolidation": "I-DISEASE",
    "mild": "B-ABNORMALITY", "clear": "I-NON-ABNORMALITY", "lungs": "B-ANATOMY",
}


def save_rate_ner(path, *, tags=TOKEN_TAGS, bias_only=None, id2label=None):
    """A tiny BertForTokenClassification whose tag per token is set by hand.

    Position and token-type embeddings and every layer's attention and feed-forward
    outputs are zeroed, so a token's final state is the layer norm of its own word
    embedding; that embedding is a spike at its tag's index, which the identity
    classifier reads back. With ``bias_only`` the classifier ignores the input and
    its bias makes that one tag win everywhere.
    """
    from transformers import BertForTokenClassification

    vocab = save_wordpiece_tokenizer(path)
    labels = list(RATE_NER_LABELS)
    config = tiny_bert_config(len(vocab), num_labels=len(labels),
                              id2label=id2label or dict(enumerate(labels)),
                              label2id={x: i for i, x in enumerate(labels)})
    model = BertForTokenClassification(config).eval()
    with torch.no_grad():
        emb = model.bert.embeddings
        emb.position_embeddings.weight.zero_()
        emb.token_type_embeddings.weight.zero_()
        emb.word_embeddings.weight.zero_()
        for token, index in vocab.items():
            tag = tags.get(token, "O")
            emb.word_embeddings.weight[index, labels.index(tag)] = 10.0
        for layer in model.bert.encoder.layer:
            for dense in (layer.attention.output.dense, layer.output.dense):
                dense.weight.zero_()
                dense.bias.zero_()
        model.classifier.weight.zero_()
        model.classifier.bias.zero_()
        if bias_only is None:
            model.classifier.weight[:, : len(labels)] = torch.eye(len(labels))
        else:
            model.classifier.bias[labels.index(bias_only)] = 5.0
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def rate_dir(tmp_path_factory):
    return save_rate_ner(tmp_path_factory.mktemp("rate-ner"))


def test_decode_bio():
    tags = ["B-ANATOMY", "I-ANATOMY", "O", "I-DISEASE", "I-DISEASE", "B-ABNORMALITY", "B-ABNORMALITY",
            "I-ANATOMY", "B-NON-DISEASE"]
    assert decode_bio(tags) == [(0, 2, "ANATOMY"), (3, 5, "DISEASE"), (5, 6, "ABNORMALITY"), (6, 7, "ABNORMALITY"),
                                (7, 8, "ANATOMY"), (8, 9, "NON-DISEASE")]
    assert decode_bio([]) == [] and decode_bio(["O", "O"]) == []
    with pytest.raises(ValueError, match="B-FINDING"):
        decode_bio(["B-FINDING"])


def test_rate_ner_entities_on_a_hand_example(rate_dir):
    from grouprl.domains.radiology.rewards.backends.rate_ner import RateNER

    ner = RateNER(rate_dir)
    assert ner.labels == list(RATE_NER_LABELS)
    report = "Small left pleural effusion. No pneumothorax.\nBilateral consolidation, heart size is normal."
    (found,) = ner.extract([report])
    assert [(e.text, e.type, e.sentence) for e in found] == [
        ("small", "ABNORMALITY", 0),
        ("left pleural", "ANATOMY", 0),
        ("effusion", "ABNORMALITY", 0),  # eff + ##usion: one word, the tag of its first piece
        ("pneumothorax", "NON-ABNORMALITY", 1),
        ("bilateral consolidation", "DISEASE", 2),  # I- without B- opens an entity
        ("heart", "ANATOMY", 2),
        ("normal", "NON-ABNORMALITY", 2),
    ]
    for e in found:
        assert isinstance(e, RateEntity) and e.head == e.text
        assert report[e.start:e.end].lower() == e.text
    sentences = split_sentences(report)
    assert sentences[1] == "No pneumothorax." and found[3].start == report.index("pneumothorax")
    assert ner.extract(["", "   "]) == [(), ()]
    assert ner.extract([report])[0] == found  # cached, same answer


def test_rate_ner_bias_forces_one_tag(tmp_path):
    from grouprl.domains.radiology.rewards.backends.rate_ner import RateNER

    ner = RateNER(save_rate_ner(tmp_path / "all-i-anatomy", bias_only="I-ANATOMY"))
    report = "Heart size is normal. Lungs are clear."
    (found,) = ner.extract([report])
    assert [(e.text, e.type, e.sentence, e.start, e.end) for e in found] == [
        ("heart size is normal.", "ANATOMY", 0, 0, 21),
        ("lungs are clear.", "ANATOMY", 1, 22, 38),
    ]
    ner = RateNER(save_rate_ner(tmp_path / "all-b-disease", bias_only="B-DISEASE"))
    assert [e.text for e in ner.extract(["Mild effusion."])[0]] == ["mild", "effusion", "."]


def test_rate_ner_refuses_unknown_or_generic_labels(tmp_path):
    from grouprl.domains.radiology.rewards.backends.rate_ner import RateNER

    generic = save_rate_ner(tmp_path / "generic", id2label={i: f"LABEL_{i}" for i in range(11)})
    with pytest.raises(ValueError, match="labels=RATE_NER_LABELS"):
        RateNER(generic)
    assert RateNER(generic, labels=RATE_NER_LABELS).labels == list(RATE_NER_LABELS)
    odd = dict(enumerate(RATE_NER_LABELS))
    odd[3] = "I-FINDING"
    with pytest.raises(ValueError, match="I-FINDING"):
        RateNER(save_rate_ner(tmp_path / "odd", id2label=odd))
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        RateNER(tmp_path / "missing")


def test_entity_fscore_matches_ratescore_py_on_rule_entities():
    from grouprl.domains.radiology.rewards.backends.rate_ner import entity_fscore

    pairs = [
        ("Small left pleural effusion. No pneumothorax.", "Small left pleural effusion. No pneumothorax."),
        ("Small left pleural effusion.", "No pleural effusion. Mild cardiomegaly."),
        ("Right lower lobe consolidation concerning for pneumonia.", "Lungs are clear. Heart size is normal."),
        ("", "Lungs are clear."),
        ("", ""),
    ]
    for hyp, ref in pairs:
        assert entity_fscore(rate_entities(hyp), rate_entities(ref)) == pytest.approx(ratescore(hyp, ref), abs=1e-12)


def test_ratescore_model_scores(rate_dir, tmp_path):
    from grouprl.domains.radiology.rewards.backends.rate_ner import RateScoreModel

    scorer = RateScoreModel(rate_dir)
    ref = "Small left pleural effusion. No pneumothorax."
    hyp = "Small left pleural effusion."
    scores = scorer.score([ref, hyp, "", "", "Heart size is normal."], [ref, ref, "", ref, "Heart size is normal."])
    # hyp: small, left pleural, effusion all matched exactly (P = 1); the reference's NON-ABNORMALITY
    # "pneumothorax" has no counterpart: R = (1 + 0.5 + 1 + 0) / (1 + 0.5 + 1 + 0.5).
    recall = 2.5 / 3.0
    assert scores == pytest.approx([1.0, 2 * recall / (1 + recall), 1.0, 0.0, 1.0])
    assert scorer.backend == f"ratescore=rate-ner:{rate_dir} (similarity=char-trigram)"

    # With a local sentence encoder (here a tiny random BERT) the similarity is an embedding cosine.
    from transformers import BertModel

    enc_dir = tmp_path / "encoder"
    vocab = save_wordpiece_tokenizer(enc_dir)
    BertModel(tiny_bert_config(len(vocab))).save_pretrained(str(enc_dir))
    with_encoder = RateScoreModel(rate_dir, enc_dir)
    scores = with_encoder.score([ref, hyp, "Heart size is normal."], [ref, ref, "Small left pleural effusion."])
    assert scores[0] == 1.0
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert with_encoder.backend.endswith(f"(similarity=encoder:{enc_dir})")


def test_ratescore_model_component(rate_dir, restore_components):
    from grouprl.domains.radiology.rewards.backends.rate_ner import register_rate_components

    component = register_rate_components(rate_dir)
    assert component.name == "ratescore_model"
    assert component.backend.startswith(f"ratescore=rate-ner:{rate_dir}")
    out = score_components(["Small left pleural effusion.", ""], ["Small left pleural effusion.", "No pneumothorax."],
                           ["ratescore_model"])
    assert out["ratescore_model"] == [1.0, 0.0]


# ============================================================================ RadGraph
from grouprl.domains.radiology.rewards.backends.radgraph_model import (  # noqa: E402
    EXTRA_HINT,
    graph_from_annotation,
    graphs_from_output,
    normalise_label,
)

ANNOTATION = {
    "text": "Small left pleural effusion . No pneumothorax .",
    "entities": {
        "1": {"tokens": "Small", "label": "OBS-DP", "start_ix": 0, "end_ix": 0, "relations": [["modify", "4"]]},
        "2": {"tokens": "left", "label": "ANAT-DP", "start_ix": 1, "end_ix": 1, "relations": [["modify", "3"]]},
        "3": {"tokens": "pleural", "label": "ANAT-DP", "start_ix": 2, "end_ix": 2, "relations": []},
        "4": {"tokens": "effusion", "label": "OBS-DP", "start_ix": 3, "end_ix": 3,
              "relations": [["located_at", "3"], ["located_at", "9"]]},  # 9 is no entity: dropped
        "10": {"tokens": "pneumothorax", "label": "OBS-DA", "start_ix": 6, "end_ix": 6, "relations": []},
    },
    "data_source": None,
    "data_split": "inference",
}


def test_graph_from_annotation():
    graph = graph_from_annotation(ANNOTATION)
    assert isinstance(graph, ReportGraph) and graph.text == ANNOTATION["text"]
    assert [(e.id, e.text, e.label, e.sentence, e.category) for e in graph.entities] == [
        (0, "small", "OBS-DP", 0, "finding"),
        (1, "left", "ANAT-DP", 0, "anatomy"),
        (2, "pleural", "ANAT-DP", 0, "anatomy"),
        (3, "effusion", "OBS-DP", 0, "finding"),
        (4, "pneumothorax", "OBS-DA", 1, "finding"),  # id "10" sorts numerically, after "4"
    ]
    for e in graph.entities:
        assert graph.text[e.start:e.end].lower() == e.text
    assert graph.triples() == [("small", "modify", "effusion"), ("left", "modify", "pleural"),
                               ("effusion", "located_at", "pleural")]
    assert radgraph_scores(graph, graph) == {level: (1.0, 1.0, 1.0) for level in ("simple", "partial", "complete")}
    flipped = json.loads(json.dumps(ANNOTATION))
    flipped["entities"]["4"]["label"] = "OBS-DA"
    scores = radgraph_scores(graph_from_annotation(flipped), graph)
    assert scores["simple"][2] == 1.0 and scores["partial"][2] == pytest.approx(0.8)
    assert graphs_from_output({"1": flipped, "0": ANNOTATION})[0] == graph
    empty = graph_from_annotation({"text": "", "entities": {}})
    assert len(empty) == 0 and radgraph_scores(empty, empty)["partial"] == (1.0, 1.0, 1.0)


def test_graph_from_annotation_radgraph_xl_labels_and_bad_spans():
    assert normalise_label("Anatomy::definitely present") == "ANAT-DP"
    assert normalise_label("Observation::definitely absent") == "OBS-DA"
    assert normalise_label("Observation::measurement::uncertain") == "OBS-U"
    assert normalise_label("Observation::definitely present") == "OBS-DP"
    assert normalise_label("OBS-U") == "OBS-U" and normalise_label("Other") == "Other"
    bad = json.loads(json.dumps(ANNOTATION))
    bad["entities"]["10"]["end_ix"] = 40
    with pytest.raises(ValueError, match="entity 10 spans tokens 6..40"):
        graph_from_annotation(bad)


def test_radgraph_missing_package_names_the_extra(monkeypatch):
    from grouprl.domains.radiology.rewards.backends.radgraph_model import RadGraphModel, register_radgraph_components

    monkeypatch.setitem(sys.modules, "radgraph", None)  # import radgraph -> ImportError
    with pytest.raises(ImportError) as info:
        RadGraphModel("radgraph-xl")
    assert EXTRA_HINT in str(info.value) and "grouprl[radgraph]" in str(info.value)
    with pytest.raises(ImportError, match=r"grouprl\[radgraph\]"):
        register_radgraph_components("radgraph-xl")


def _transformers_major() -> int:
    return int(transformers.__version__.split(".")[0])


@pytest.fixture
def radgraph_pkg():
    return pytest.importorskip("radgraph")


def test_radgraph_model_type_must_be_local(radgraph_pkg, monkeypatch, tmp_path):
    from grouprl.domains.radiology.rewards.backends.radgraph_model import RadGraphModel

    monkeypatch.setattr(radgraph_pkg.radgraph, "CACHE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="grouprl never does"):
        RadGraphModel("radgraph-xl")
    with pytest.raises(FileNotFoundError, match="neither a local directory"):
        RadGraphModel(tmp_path / "nowhere")


def _radgraph_dir(root, bert_dir, *, build_weights: bool):
    """A tiny RadGraph (DyGIE) model directory in the package's format: config.json, vocabulary/, weights.th."""
    model_dir = root / "tiny-radgraph"  # not named after its type: the type comes from the vocabulary
    (model_dir / "vocabulary").mkdir(parents=True)
    (model_dir / "vocabulary" / "non_padded_namespaces.txt").write_text("*tags\n*labels\n")
    (model_dir / "vocabulary" / "radgraph__ner_labels.txt").write_text("\nANAT-DP\nOBS-DP\nOBS-U\nOBS-DA\n")
    (model_dir / "vocabulary" / "radgraph__relation_labels.txt").write_text("located_at\nmodify\nsuggestive_of\n")
    bert = {"type": "pretrained_transformer_mismatched", "model_name": "some-org/not-on-this-machine",
            "max_length": 64}
    model = {
        "type": "dygie", "embedder": {"token_embedders": {"bert": bert}},
        "feature_size": 4, "max_span_width": 3, "target_task": "relation",
        "feedforward_params": {"num_layers": 1, "hidden_dims": 8, "dropout": 0.0},
        "initializer": {"regexes": []}, "module_initializer": {"regexes": []},
        "loss_weights": {"ner": 1.0, "relation": 1.0, "coref": 0.0, "events": 0.0},
        "modules": {"coref": {"spans_per_word": 0.3, "max_antecedents": 10, "coref_prop": 0}, "ner": {},
                    "relation": {"spans_per_word": 0.5},
                    "events": {"trigger_spans_per_word": 0.3, "argument_spans_per_word": 0.8,
                               "loss_weights": {"trigger": 1.0, "arguments": 1.0}}},
    }
    config = {"dataset_reader": {"type": "dygie", "max_span_width": 3, "token_indexers": {"bert": bert}},
              "model": model}
    (model_dir / "config.json").write_text(json.dumps(config))
    state = {}
    if build_weights:  # through the package's own classes, pointed at the local tiny BERT
        from dotmap import DotMap
        from radgraph.allennlp.data import Vocabulary
        from radgraph.allennlp.modules import text_field_embedders, token_embedders
        from radgraph.dygie.models import dygie

        vocab = Vocabulary.from_files(str(model_dir / "vocabulary"))
        embedder = text_field_embedders.BasicTextFieldEmbedder(
            {"bert": token_embedders.PretrainedTransformerMismatchedEmbedder(model_name=str(bert_dir), max_length=64)})
        params = DotMap(json.loads(json.dumps(model)))
        for name in ("type", "embedder", "initializer", "module_initializer"):
            del params[name]
        torch.manual_seed(0)
        state = dygie.DyGIE(vocab=vocab, embedder=embedder, **params).state_dict()
    torch.save(state, model_dir / "weights.th")
    return model_dir


@pytest.fixture
def tiny_bert_dir(tmp_path):
    from transformers import BertModel

    path = tmp_path / "tiny-bert"
    vocab = save_wordpiece_tokenizer(path)
    BertModel(tiny_bert_config(len(vocab), hidden_size=16, num_hidden_layers=1,
                               intermediate_size=32)).save_pretrained(str(path))
    return path


@pytest.mark.skipif(_transformers_major() < 5, reason="checks the error radgraph 0.1.x gives under transformers 5")
def test_radgraph_under_transformers_5_says_why(radgraph_pkg, tmp_path, tiny_bert_dir):
    from grouprl.domains.radiology.rewards.backends.radgraph_model import RadGraphModel

    model_dir = _radgraph_dir(tmp_path, tiny_bert_dir, build_weights=False)
    with pytest.raises(FileNotFoundError, match="transformer_path"):
        RadGraphModel(model_dir)  # the config's BERT is neither local nor cached: never downloaded
    from importlib.metadata import version

    if tuple(int(x) for x in version("radgraph").split(".")[:3]) > (0, 1, 18):
        pytest.skip("a radgraph release newer than 0.1.18 may work with transformers 5")
    with pytest.raises(RuntimeError, match="transformers < 5"):
        RadGraphModel(model_dir, transformer_path=tiny_bert_dir)


@pytest.mark.skipif(_transformers_major() >= 5, reason="radgraph 0.1.x calls tokenizer.encode_plus (transformers < 5)")
def test_radgraph_model_loads_from_local_files(radgraph_pkg, tmp_path, tiny_bert_dir, restore_components):
    from grouprl.domains.radiology.rewards.backends.radgraph_model import RadGraphModel, register_radgraph_components

    model_dir = _radgraph_dir(tmp_path, tiny_bert_dir, build_weights=True)
    files_before = sorted(p.name for p in model_dir.rglob("*"))
    model = RadGraphModel(model_dir, transformer_path=tiny_bert_dir)
    assert model.model_type == "radgraph"
    assert sorted(p.name for p in model_dir.rglob("*")) == files_before  # the user's files are never written
    texts = ["Small left pleural effusion. No pneumothorax.", "", "Heart size is normal."]
    annotations = model.annotate(texts)
    assert annotations[1] == {"text": "", "entities": {}}
    graphs = model.graphs(texts)
    for annotation, graph in zip(annotations, graphs):
        assert graph == graph_from_annotation(annotation)
        for e in graph.entities:
            assert e.label in ("ANAT-DP", "OBS-DP", "OBS-U", "OBS-DA")
    assert annotations[0]["text"] == "Small left pleural effusion . No pneumothorax ."
    assert model.f1(texts[:1], texts[:1]) == [1.0]
    assert model.f1([""], [""]) == [1.0] and model.package_f1([""], [""]) == [0.0]
    registered = register_radgraph_components(model_dir, transformer_path=tiny_bert_dir)
    assert registered[0].backend == f"radgraph=radgraph-package:{model_dir}"
    out = score_components(texts[:1], texts[:1], ["radgraph_model_f1", "radgraph_model_f1_package"])
    assert out["radgraph_model_f1"] == [1.0]
    assert 0.0 <= out["radgraph_model_f1_package"][0] <= 1.0
