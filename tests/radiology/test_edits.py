"""EditGRPO post-rollout edits: the sentence operations and the batch transform, on hand-built batches."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl.data.sample import Sample
from grouprl.models.tiny import build_tokenizer
from grouprl.domains.radiology.rewards.entities import split_sentences
from grouprl.rollout.batch import RolloutBatch
from grouprl.domains.radiology import edits
from grouprl.domains.radiology.edits import (
    EXTRACTORS,
    EditOperation,
    EditTransform,
    build_extractor,
    edit_report,
    get_extractor,
    register_extractor,
    sentence_similarity,
)

REF_A = "No pleural effusion. No pneumothorax."
REF_B = "The heart size is normal. There is right lower lobe atelectasis."

CORPUS = [
    REF_A,
    REF_B,
    "There is a small left pleural effusion. A pacemaker is present.",
    "The heart size is normal. There is a right lower lobe pneumonia.",
] * 4


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(CORPUS)


# ----------------------------------------------------------------------------- edit_report
def test_contradiction_is_corrected_with_the_reference_sentence():
    result = edit_report("There is a small left pleural effusion. No pneumothorax.", REF_A)
    assert result.operations == [EditOperation("correct", "There is a small left pleural effusion.",
                                               "No pleural effusion.", 0)]
    assert result.text == "No pleural effusion. No pneumothorax."


def test_false_positive_sentence_is_replaced_by_the_most_similar_reference_sentence():
    result = edit_report("The heart size is normal. There is a right lower lobe pneumonia.", REF_B)
    assert [op.type for op in result.operations] == ["replace"]
    op = result.operations[0]
    assert (op.before, op.after, op.sentence_index) == (
        "There is a right lower lobe pneumonia.", "There is right lower lobe atelectasis.", 1)
    assert result.text == REF_B


def test_false_positive_sentence_without_a_similar_reference_sentence_is_deleted():
    result = edit_report("The heart size is normal. A pacemaker is present.", "The heart size is normal. No pneumothorax.")
    assert result.operations == [EditOperation("delete", "A pacemaker is present.", "", 1)]
    assert result.text == "The heart size is normal."


def test_missing_reference_sentence_is_added():
    result = edit_report("The heart size is normal.", "The heart size is normal. No pneumothorax.")
    assert result.operations == [EditOperation("add", "", "No pneumothorax.", 1)]
    assert result.text == "The heart size is normal. No pneumothorax."


def test_empty_response_is_filled_with_one_reference_sentence():
    for response in ("", "  \n "):
        result = edit_report(response, REF_A)
        assert [op.type for op in result.operations] == ["fill"]
        assert result.text in split_sentences(REF_A)
        assert result.operations[0].after == result.text


def test_identical_response_gets_no_operation():
    for report in (REF_A, REF_B, "Mild cardiomegaly. Small left pleural effusion. Lungs are clear."):
        result = edit_report(report, report, num_ops=5)
        assert result.operations == []
        assert result.text == report


def test_tau_boundary_similarity_at_tau_replaces_just_below_deletes():
    response = "The heart size is normal. There is a right lower lobe pneumonia."
    s = sentence_similarity("There is a right lower lobe pneumonia.", "There is right lower lobe atelectasis.")
    assert 0.0 < s < 1.0
    assert [op.type for op in edit_report(response, REF_B, tau=s).operations] == ["replace"]
    assert [op.type for op in edit_report(response, REF_B, tau=math.nextafter(s, 1.0)).operations] == ["delete"]
    assert edit_report(response, REF_B, tau=math.nextafter(s, 1.0)).text == "The heart size is normal."


def test_sentence_similarity_is_one_for_identical_sentences():
    assert sentence_similarity("No pneumothorax.", "No pneumothorax.") == 1.0
    assert sentence_similarity("No pneumothorax.", "no pneumothorax") == 1.0
    assert sentence_similarity("A pacemaker is present.", "No pneumothorax.") < 0.6


def test_operations_follow_priority_up_to_num_ops():
    response = "There is a small left pleural effusion. A pacemaker is present."
    types = ["correct", "delete", "add"]
    for k in range(4):
        result = edit_report(response, REF_A, num_ops=k)
        assert [op.type for op in result.operations] == types[:k]
    assert edit_report(response, REF_A, num_ops=0).text == response
    full = edit_report(response, REF_A, num_ops=10)
    assert [op.type for op in full.operations] == types  # nothing left to do after three
    assert full.text == REF_A


def test_added_sentence_stays_a_separate_sentence_after_an_unpunctuated_one():
    result = edit_report("Heart size is normal", "Heart size is normal. No pneumothorax.")
    assert result.text == "Heart size is normal\nNo pneumothorax."
    assert split_sentences(result.text) == ["Heart size is normal", "No pneumothorax."]


def test_edits_are_seeded():
    reference = ("No pneumothorax. No pleural effusion. Heart size is normal. Lungs are clear. "
                 "No focal consolidation. Mild cardiomegaly.")
    first = edit_report("", reference, seed=3)
    assert first == edit_report("", reference, seed=3)
    fills = {edit_report("", reference, seed=s).text for s in range(30)}
    assert len(fills) > 1
    assert fills <= set(split_sentences(reference))
    # which of several false-positive sentences goes first is seeded too
    response = "A pacemaker is present. There is a right lower lobe pneumonia. Mild cardiomegaly."
    befores = {edit_report(response, "Lungs are clear.", seed=s).operations[0].before for s in range(30)}
    assert len(befores) > 1


def test_extractor_registry():
    assert "rules" in EXTRACTORS
    with pytest.raises(ValueError, match="build_extractor"):
        get_extractor("radgraph")  # a model extractor is never a registered one
    with pytest.raises(ValueError, match=r"available extractors: \['radgraph', 'ratescore', 'rules'\]"):
        get_extractor("chexbert")
    with pytest.raises(ValueError, match=r"available extractors: .*'ratescore'.*'rules'"):
        edit_report(REF_A, REF_A, extractor="chexbert")
    with pytest.raises(ValueError, match="available extractors"):
        EditTransform(None, eos_token_id=0, pad_token_id=0, extractor="chexbert")


# ----------------------------------------------------------------------------- the transform
GROUP_RESPONSES = {
    # every response of these groups needs at least one edit
    REF_A: ["There is a small left pleural effusion. No pneumothorax.", "A pacemaker is present.",
            "No pleural effusion.", "", "There is a small left pleural effusion. A pacemaker is present."],
    REF_B: ["The heart size is normal. There is a right lower lobe pneumonia.", "The heart size is normal.",
            "There is right lower lobe atelectasis.", "A pacemaker is present. The heart size is normal.",
            "The heart size is normal. No pneumothorax."],
}


def make_batch(tokenizer, groups: list[tuple[str, list[str]]], *, truncate_to: int | None = None) -> RolloutBatch:
    """Rows of each (reference, responses) group as an engine would return them: EOS, right padding."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    samples, group_index, rows, responses = [], [], [], []
    for g, (reference, texts) in enumerate(groups):
        sample = Sample(messages=[{"role": "user", "content": f"Report {g}"}], answer=reference, index=g)
        for text in texts:
            samples.append(sample)
            group_index.append(g)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            rows.append(ids[:truncate_to] if truncate_to else ids)
            responses.append(text)
    width = max(len(r) for r in rows)
    response_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    response_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, ids in enumerate(rows):
        response_ids[i, :len(ids)] = torch.tensor(ids)
        response_mask[i, :len(ids)] = 1
    prompt_ids = torch.tensor([tokenizer(f"Report {g}")["input_ids"] for g in group_index])
    return RolloutBatch(
        samples=samples,
        group_index=torch.tensor(group_index),
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones_like(prompt_ids),
        response_ids=response_ids,
        response_mask=response_mask,
        responses=responses,
        truncated=torch.tensor([bool(truncate_to) and len(r) == truncate_to for r in rows]),
    )


def transform(tokenizer, **options) -> EditTransform:
    return EditTransform(tokenizer, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **options)


def two_groups(tokenizer, **kwargs) -> RolloutBatch:
    return make_batch(tokenizer, list(GROUP_RESPONSES.items()), **kwargs)


def apply_operation(text: str, op: dict) -> str:
    """One recorded operation replayed on a single-spaced report."""
    sentences = split_sentences(text)
    if op["type"] in ("add", "fill"):
        sentences.append(op["after"])
    else:
        assert sentences[op["sentence_index"]] == op["before"]
        sentences[op["sentence_index"]] = op["after"]
    return " ".join(x for x in sentences if x)


def check_rows_encode_their_text(tokenizer, batch: RolloutBatch) -> None:
    """Every row: its text's tokens then EOS, 1s on exactly those in the mask, padding after."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert batch.response_ids.shape == batch.response_mask.shape == batch.loss_mask.shape
    assert batch.response_ids.shape[1] == int(batch.response_mask.sum(-1).max())
    for i, text in enumerate(batch.responses):
        if batch.truncated[i]:
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        length = int(batch.response_mask[i].sum())
        assert length == len(ids) + 1
        assert batch.response_ids[i, :length].tolist() == ids + [eos]
        assert batch.response_ids[i, length - 1] == eos
        assert batch.response_mask[i, :length].all() and not batch.response_mask[i, length:].any()
        assert (batch.response_ids[i, length:] == pad).all()


def test_num_para_minus_one_group_layout(tokenizer):
    batch = two_groups(tokenizer)
    t = transform(tokenizer, num_para=-1)
    out = t(batch)
    assert len(out) == len(batch) == 10
    assert out.group_index.tolist() == batch.group_index.tolist()  # group sizes and order unchanged
    sources, edits = out.extras["edit_source"], out.extras["edit_operations"]
    for g in (0, 1):
        rows = [i for i in range(10) if batch.group_index[i] == g]
        edited = [i for i in rows if out.edited[i]]
        assert len(edited) == 5 // 2
        used_sources = [sources[i] for i in edited]
        assert len(set(used_sources)) == len(used_sources)  # distinct sources, each copy in a distinct slot
        for target, source in zip(edited, used_sources):
            assert source != target and source in rows  # a copy of another response of the same group
            assert not out.edited[source]
            assert out.responses[source] == batch.responses[source]  # the source itself is kept as sampled
            assert out.response_ids[source, : int(batch.response_mask[source].sum())].tolist() == \
                batch.response_ids[source, : int(batch.response_mask[source].sum())].tolist()
            assert edits[target] and out.responses[target] != batch.responses[source]
            # the copy is the source with its one recorded operation applied
            assert len(edits[target]) == 1
            assert out.responses[target] == apply_operation(batch.responses[source], edits[target][0])
            assert out.samples[target] is batch.samples[source]
        for i in rows:
            if not out.edited[i]:
                assert out.responses[i] == batch.responses[i] and edits[i] == [] and sources[i] is None
    assert t.last_metrics["edits/edit_rate"] == pytest.approx(4 / 10)
    assert sum(t.last_metrics[f"edits/op_{k}"] for k in ("correct", "replace", "delete", "add", "fill")) == 4
    check_rows_encode_their_text(tokenizer, out)


def test_num_para_minus_one_skips_responses_that_need_no_edit(tokenizer):
    # only one response of the group differs from the reference: one copy, not two
    batch = make_batch(tokenizer, [(REF_A, [REF_A, REF_A, "No pleural effusion.", REF_A, REF_A])])
    out = transform(tokenizer, num_para=-1)(batch)
    assert int(out.edited.sum()) == 1
    target = int(out.edited.nonzero())
    assert out.extras["edit_source"][target] == 2
    assert out.responses[target] == REF_A
    assert out.responses[2] == "No pleural effusion."


def test_num_para_k_edits_k_rows_in_place(tokenizer):
    batch = two_groups(tokenizer)
    t = transform(tokenizer, num_para=3, num_ops_per_para=1)
    out = t(batch)
    edited = out.edited.nonzero().squeeze(-1).tolist()
    assert len(edited) == 3
    for i in range(10):
        if i in edited:
            assert out.extras["edit_source"][i] == i
            assert len(out.extras["edit_operations"][i]) == 1
            expected = edit_report(batch.responses[i], batch.samples[i].answer, num_ops=1)
            assert out.responses[i] != batch.responses[i]
            assert out.extras["edit_operations"][i][0]["type"] == expected.operations[0].type
        else:
            assert out.responses[i] == batch.responses[i]
    assert t.last_metrics["edits/edit_rate"] == pytest.approx(0.3)
    check_rows_encode_their_text(tokenizer, out)


def test_num_para_zero_changes_nothing(tokenizer):
    batch = two_groups(tokenizer)
    t = transform(tokenizer, num_para=0)
    out = t(batch)
    assert out.responses == batch.responses and torch.equal(out.response_ids, batch.response_ids)
    assert not out.edited.any()
    assert out.extras["edit_operations"] == [[]] * 10 and out.extras["edit_source"] == [None] * 10
    assert t.last_metrics["edits/edit_rate"] == 0.0


def test_force_gt_uses_each_prompts_own_reference(tokenizer):
    references = ["No pneumothorax.", "No pleural effusion.", "The heart size is normal.", "A pacemaker is present."]
    groups = [(ref, ["There is a right lower lobe pneumonia."] * 3) for ref in references]
    batch = make_batch(tokenizer, groups)
    for seed in range(5):
        t = transform(tokenizer, num_para=0, force_gt_num=3, seed=seed)
        out = t(batch)
        forced = out.edited.nonzero().squeeze(-1).tolist()
        assert len(forced) == 3
        assert len({int(out.group_index[i]) for i in forced}) == 3  # one row in each of three prompts
        for i in forced:
            assert out.responses[i] == references[int(out.group_index[i])] == out.samples[i].answer
            assert out.extras["edit_operations"][i][0]["type"] == "force_gt"
            assert out.extras["edit_source"][i] is None
        assert t.last_metrics["edits/force_gt"] == 3.0
        check_rows_encode_their_text(tokenizer, out)


def test_force_gt_rows_are_not_overwritten_by_edit_copies(tokenizer):
    batch = two_groups(tokenizer)
    out = transform(tokenizer, num_para=-1, force_gt_num=2)(batch)
    for g, reference in enumerate(GROUP_RESPONSES):
        rows = [i for i in range(10) if out.group_index[i] == g]
        forced = [i for i in rows if out.extras["edit_operations"][i][:1] and
                  out.extras["edit_operations"][i][0]["type"] == "force_gt"]
        assert len(forced) == 1 and out.responses[forced[0]] == reference
        copies = [i for i in rows if out.extras["edit_source"][i] is not None]
        assert len(copies) == 4 // 2  # floor(m/2) of the m = 4 rows force_gt left
        assert forced[0] not in copies and forced[0] not in [out.extras["edit_source"][i] for i in copies]


def test_edited_rows_get_eos_masks_and_a_wider_batch(tokenizer):
    # responses cut to 3 tokens (no EOS, truncated) so that edited rows are longer than the batch
    # (the empty response is a lone EOS, not truncated)
    batch = two_groups(tokenizer, truncate_to=3)
    assert batch.truncated.sum() == 9 and batch.response_ids.shape[1] == 3
    out = transform(tokenizer, num_para=-1)(batch)
    assert out.response_ids.shape[1] > 3
    for i in range(10):
        if out.edited[i]:
            assert not out.truncated[i]
            assert torch.equal(out.loss_mask[i], out.response_mask[i])
        else:  # untouched rows are the same tokens, padded on the right
            length = int(batch.response_mask[i].sum())
            assert out.truncated[i] == batch.truncated[i]
            assert out.response_ids[i, :3].tolist() == batch.response_ids[i].tolist()
            assert out.response_mask[i].sum() == length and not out.response_mask[i, length:].any()
            assert (out.response_ids[i, length:] == tokenizer.pad_token_id).all()
    check_rows_encode_their_text(tokenizer, out)


def test_empty_edited_report_is_a_lone_eos(tokenizer):
    batch = make_batch(tokenizer, [("The heart size is normal.", ["A pacemaker is present."])])
    out = transform(tokenizer, num_para=1)(batch)
    assert out.responses == [""]
    assert out.response_ids[0, :1].tolist() == [tokenizer.eos_token_id] and out.response_mask[0].sum() == 1


def test_edited_tokens_mask_leaves_edited_rows_out_of_the_loss(tokenizer):
    batch = two_groups(tokenizer)
    out = transform(tokenizer, num_para=-1, edited_tokens="mask")(batch)
    for i in range(10):
        if out.edited[i]:
            assert out.loss_mask[i].sum() == 0 and out.response_mask[i].sum() > 0
        else:
            assert torch.equal(out.loss_mask[i], out.response_mask[i])


def test_stale_per_token_values_are_invalidated(tokenizer):
    batch = two_groups(tokenizer)
    width = batch.response_ids.shape[1]
    batch.old_log_probs = torch.zeros(10, width)
    batch.ref_log_probs = torch.zeros(10, width)
    batch.rollout_log_probs = -torch.ones(10, width) * batch.response_mask
    out = transform(tokenizer, num_para=2)(batch)
    assert out.old_log_probs is None and out.ref_log_probs is None
    for i in range(10):
        if out.edited[i]:
            assert torch.isnan(out.rollout_log_probs[i]).all()
        else:
            length = int(batch.response_mask[i].sum())
            assert (out.rollout_log_probs[i, :length] == -1).all()
    # nothing changed: the log-probs stay
    kept = transform(tokenizer, num_para=0)(batch)
    assert kept.old_log_probs is batch.old_log_probs


def test_transform_is_seeded_by_seed_and_batch(tokenizer):
    batch = two_groups(tokenizer)
    a = transform(tokenizer, num_para=-1, seed=1)(batch)
    b = transform(tokenizer, num_para=-1, seed=1)(batch)
    assert a.responses == b.responses and a.extras == b.extras and torch.equal(a.response_ids, b.response_ids)
    layouts = {tuple(transform(tokenizer, num_para=-1, seed=s)(batch).extras["edit_source"]) for s in range(10)}
    assert len(layouts) > 1


def test_input_batch_is_not_modified(tokenizer):
    batch = two_groups(tokenizer)
    before = (list(batch.responses), batch.response_ids.clone(), batch.loss_mask.clone(), batch.edited.clone())
    transform(tokenizer, num_para=-1, force_gt_num=1)(batch)
    assert batch.responses == before[0] and torch.equal(batch.response_ids, before[1])
    assert torch.equal(batch.loss_mask, before[2]) and torch.equal(batch.edited, before[3])
    assert "edit_operations" not in batch.extras


def test_transform_output_concatenates_and_selects(tokenizer):
    # dynamic sampling concatenates rounds and selects groups: the edit columns must survive both
    t = transform(tokenizer, num_para=-1)
    a, b = t(two_groups(tokenizer)), t(two_groups(tokenizer, truncate_to=4))
    both = RolloutBatch.concat([a, b], pad_token_id=tokenizer.pad_token_id)
    assert len(both.extras["edit_operations"]) == 20
    sub = both.select([0, 11])
    assert sub.extras["edit_source"] == [both.extras["edit_source"][0], both.extras["edit_source"][11]]


def test_invalid_options():
    with pytest.raises(ValueError, match="num_para"):
        EditTransform(None, eos_token_id=0, pad_token_id=0, num_para=-2)
    with pytest.raises(ValueError, match="edited_tokens"):
        EditTransform(None, eos_token_id=0, pad_token_id=0, edited_tokens="weight")
    with pytest.raises(ValueError, match="tau"):
        edit_report("a.", "b.", tau=1.5)


# ----------------------------------------------------------------------------- model extractors
from grouprl.domains.radiology.rewards.ratescore import RateEntity, match_entities  # noqa: E402

HEART = "Heart size is normal."


def test_match_entities_takes_extracted_entities():
    ref = [RateEntity("small effusion", "effusion", "ABNORMALITY", 0, 0, 14),
           RateEntity("left pleura", "left pleura", "ANATOMY", 0, 18, 29)]
    same = match_entities(list(ref), tuple(ref))
    assert [p.relation for p in same.pairs] == ["match", "match"] and same.false_negatives == ()
    assert same.hyp_entities == tuple(ref)
    negated = [ref[0]._replace(text="effusion", type="NON-ABNORMALITY"), ref[1]]
    flipped = match_entities(negated, ref)
    assert [p.relation for p in flipped.pairs] == ["contradiction", "match"]
    assert flipped.contradictions[0].ref == ref[0] and flipped.false_negatives == ()
    with pytest.raises(TypeError, match="RateEntity"):
        match_entities([("small effusion", "effusion")], ref)


def test_model_extractor_needs_its_model_path():
    for name in ("ratescore", "radgraph"):
        for path in (None, "", "  "):
            with pytest.raises(ValueError, match=r"worker\.rollout\.extractor_model_path"):
                build_extractor(name, path)
        with pytest.raises(ValueError, match=r"worker\.rollout\.extractor_model_path"):
            EditTransform(None, eos_token_id=0, pad_token_id=0, extractor=name)
        with pytest.raises(ValueError, match=r"worker\.rollout\.extractor_model_path"):
            edit_report(HEART, HEART, extractor=name)
    with pytest.raises(ValueError, match="only read by the model extractors"):
        build_extractor("rules", "/some/model")
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_extractor("ratescore", "/nonexistent/rate-ner")  # loaded at construction, not at the first step


def test_custom_extractor_is_built_by_name():
    calls = []

    @register_extractor("test-everything-fp")
    def everything_fp(response, reference):
        calls.append(response)
        return match_entities(response, "", threshold=0.6)

    try:
        assert build_extractor("test-everything-fp") is everything_fp
        result = edit_report("Small left pleural effusion. " + HEART, HEART, extractor="test-everything-fp")
        assert calls and result.operations[0].type in ("replace", "delete")
    finally:
        EXTRACTORS.pop("test-everything-fp")
    with pytest.raises(ValueError, match="model extractor"):
        register_extractor("ratescore")


@pytest.fixture(scope="module")
def rate_ner_dir(tmp_path_factory):
    """A tiny RaTE-NER (test_model_backends' forced-prediction model) that sees "there" as an abnormality
    and nothing in "lungs are clear", unlike the rules."""
    pytest.importorskip("transformers")
    from test_model_backends import TOKEN_TAGS, save_rate_ner

    tags = {**TOKEN_TAGS, "lungs": "O", "clear": "O", "there": "B-ABNORMALITY"}
    return str(save_rate_ner(tmp_path_factory.mktemp("edits-rate-ner"), tags=tags))


def test_ratescore_extractor_edits_the_model_false_positive(rate_ner_dir):
    model_fp, rules_fp = HEART + " There is.", HEART + " The lungs are clear."
    ops = edit_report(model_fp, HEART, extractor="ratescore", extractor_model_path=rate_ner_dir).operations
    assert [(op.type, op.before, op.sentence_index) for op in ops] == [("delete", "There is.", 1)]
    assert edit_report(model_fp, HEART).operations == []  # the rules see no entity there
    assert edit_report(rules_fp, HEART, extractor="ratescore", extractor_model_path=rate_ner_dir).operations == []
    assert [op.before for op in edit_report(rules_fp, HEART).operations] == ["The lungs are clear."]
    matching = build_extractor("ratescore", rate_ner_dir)(model_fp, HEART)
    assert [(e.text, e.type, e.sentence) for e in matching.false_positives] == [("there", "ABNORMALITY", 1)]


def test_ratescore_model_is_loaded_once_per_path(rate_ner_dir, monkeypatch):
    from grouprl.domains.radiology.rewards.backends import rate_ner

    made = []

    class Counting(rate_ner.RateNER):
        def __init__(self, *args, **kwargs):
            made.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(rate_ner, "RateNER", Counting)
    monkeypatch.setattr(rate_ner, "_NER", {})
    first = build_extractor("ratescore", rate_ner_dir)
    second = build_extractor("ratescore", rate_ner_dir)
    assert first(HEART, HEART).false_positives == [] and second(HEART, HEART).false_positives == []
    assert made == [rate_ner_dir]


def test_edit_transform_with_the_ratescore_extractor(tokenizer, rate_ner_dir):
    responses = [HEART + " There is.", HEART + " The lungs are clear."]
    for extractor, path, source, target in (("ratescore", rate_ner_dir, 0, 1), ("rules", None, 1, 0)):
        t = transform(tokenizer, extractor=extractor, extractor_model_path=path)
        assert t.extractor == extractor and t.extractor_model_path == path
        out = t(make_batch(tokenizer, [(HEART, responses)]))
        assert out.extras["edit_source"] == [None, None][:target] + [source] + [None, None][target + 1:]
        assert out.responses[target] == HEART and out.responses[source] == responses[source]
        assert [op["type"] for op in out.extras["edit_operations"][target]] == ["delete"]
        assert out.edited.tolist() == [i == target for i in range(2)]


def test_radgraph_extractor_wiring_with_a_test_double(monkeypatch, tmp_path):
    """The radgraph package (0.1.18) does not load under transformers 5, so a stand-in for
    RadGraphModel returns the package's annotations (its tokenized text) for two reports."""
    from grouprl.domains.radiology.rewards.backends import radgraph_model
    from grouprl.domains.radiology.rewards.backends.radgraph_model import graph_from_annotation

    response = "Small left pleural effusion. No pneumothorax."
    reference = "No pleural effusion. No pneumothorax."
    annotations = {
        response: {"text": "Small left pleural effusion . No pneumothorax .", "entities": {
            "1": {"tokens": "Small", "label": "OBS-DP", "start_ix": 0, "end_ix": 0, "relations": [["modify", "4"]]},
            "3": {"tokens": "pleural", "label": "ANAT-DP", "start_ix": 2, "end_ix": 2, "relations": []},
            "4": {"tokens": "effusion", "label": "OBS-DP", "start_ix": 3, "end_ix": 3,
                  "relations": [["located_at", "3"]]},
            "5": {"tokens": "pneumothorax", "label": "OBS-DA", "start_ix": 6, "end_ix": 6, "relations": []}}},
        reference: {"text": "No pleural effusion . No pneumothorax .", "entities": {
            "1": {"tokens": "pleural", "label": "ANAT-DP", "start_ix": 1, "end_ix": 1, "relations": []},
            "2": {"tokens": "effusion", "label": "OBS-DA", "start_ix": 2, "end_ix": 2,
                  "relations": [["located_at", "1"]]},
            "3": {"tokens": "pneumothorax", "label": "OBS-DA", "start_ix": 5, "end_ix": 5, "relations": []}}},
    }
    made = []

    class FakeRadGraphModel:
        def __init__(self, model_path_or_type, **kwargs):
            made.append(str(model_path_or_type))

        def graphs(self, texts):
            return [graph_from_annotation(annotations[t]) for t in texts]

    monkeypatch.setattr(radgraph_model, "RadGraphModel", FakeRadGraphModel)
    monkeypatch.setattr(radgraph_model, "_MODELS", {})
    path = str(tmp_path / "radgraph")
    extract = build_extractor("radgraph", path)
    assert build_extractor("radgraph", path) is not None and made == [path]  # loaded once per path
    matching = extract(response, reference)
    # entity positions refer to the report, not to the package's tokenized text
    assert [(response[e.start:e.end], e.text, e.type, e.sentence) for e in matching.hyp_entities] == [
        ("pleural", "pleural", "ANATOMY", 0),
        ("Small left pleural effusion", "small effusion", "ABNORMALITY", 0),
        ("pneumothorax", "pneumothorax", "NON-ABNORMALITY", 1),
    ]
    assert [(p.hyp.text, p.ref.text) for p in matching.contradictions] == [("small effusion", "effusion")]
    result = edit_report(response, reference, extractor="radgraph", extractor_model_path=path)
    assert [(op.type, op.before, op.after) for op in result.operations] == [
        ("correct", "Small left pleural effusion.", "No pleural effusion.")]
    assert result.text == "No pleural effusion. No pneumothorax."
    t = EditTransform(None, eos_token_id=0, pad_token_id=0, extractor="radgraph", extractor_model_path=path)
    assert t._extract(response, reference).contradictions and made == [path]


def test_radgraph_entities_of_a_differently_spaced_text_keep_in_range_sentences():
    from grouprl.domains.radiology.rewards.backends.radgraph_model import graph_from_annotation

    graph = graph_from_annotation({"text": "a . b . effusion .", "entities": {
        "1": {"tokens": "effusion", "label": "OBS-DP", "start_ix": 4, "end_ix": 4}}})
    (entity,) = edits._graph_entities(graph, "Effusion.")  # not the same text: sentence clamped
    assert entity.sentence == 0
    assert edits._graph_entities(graph, "") == ()
