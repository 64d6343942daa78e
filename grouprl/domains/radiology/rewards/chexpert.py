"""CheXpert-style observation labels for a chest X-ray report, by rules.

``label_report(text)`` gives each of the 14 CheXpert observations (``OBSERVATIONS``)
a label: ``1`` positive, ``0`` negative, ``-1`` uncertain, ``None`` not mentioned.
It follows the published behaviour of the CheXpert labeler (Irvin et al. 2019),
with rules of its own: it needs no parser and no weights, labels thousands of
reports a second on one core, and every score built on it says so (``BACKEND``).

How a report is read:

1. The text is lower-cased and cut into clauses at sentence ends, ``;``, ``:``,
   blank lines and line breaks that start a new statement (a list item or a
   capital letter; other line breaks are word wrap).
2. One pass over the word starts finds, left to right and without overlap, the
   phrases that matter: mention phrases per observation (``MENTIONS``, ``SHARED_MENTIONS``);
   statements with their own verb ("the heart is mildly enlarged", "heart size is
   normal": ``STATEMENTS``); look-alikes that are no mention ("pericardial
   effusion", "pleural line": ``LOOK_ALIKES``); negation and uncertainty cues
   (``NEGATION_CUES``, ``UNCERTAINTY_CUES``, ``NEGATED_UNCERTAINTY_CUES``); and
   the words that end a cue's reach (``SCOPE_BREAKERS``, ``AUXILIARIES``, and
   ``PSEUDO_NEGATIONS`` such as "no change in", which negate nothing).
3. Cues govern mentions within the clause:
   - a cue *before* mentions ("no", "without", "possible", "cannot exclude")
     reaches every mention after it, through lists ("no focal consolidation,
     effusion, or pneumothorax"), until a scope breaker ("but", "with", "which",
     a finite verb, ...) or the clause end;
   - a cue *after* mentions ("is not seen", "has resolved", "cannot be ruled out")
     reaches back over auxiliaries to the mention or list of mentions before it,
     never across a comma;
   - a cue that may sit on either side ("possible", "likely", "may", "resolved")
     goes forward when a mention follows it directly, otherwise back
     ("atelectasis is likely", "opacity likely reflects atelectasis"); a modal
     verb goes back only when it ends the statement ("effusion may be present",
     but not "opacity may be due to scarring");
   - two mentions joined by "or" / "versus" are alternatives: each uncertain
     unless negated ("atelectasis versus pneumonia").
   A mention is uncertain if a negated-uncertainty cue ("cannot exclude") reaches
   it, else negative if a negation does, else uncertain if an uncertainty cue
   does, else positive. Statements carry their own polarity ("the heart is not
   enlarged" is 0, "the heart may be enlarged" -1) and ignore cues outside them.
4. Over the report, positive beats uncertain beats negative beats not mentioned.
   "No Finding" is 1 when no pathology (every observation but Support Devices) is
   positive or uncertain, else None -- never 0, as in the original labeler. An
   empty or blank text is not a report: every label, No Finding included, is None.

Like the original, "lungs are clear" labels nothing (the labeler's own sample has
Lung Opacity blank for it), while "heart size normal" is Cardiomegaly 0.
"""

from __future__ import annotations

import re
from typing import Sequence

try:  # the regex parser, to find which letters a phrase can start with
    from re import _parser as _sre_parse  # Python >= 3.11
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse

BACKEND = "labeler=rules"

OBSERVATIONS: tuple[str, ...] = (
    "No Finding",
    "Enlarged Cardiomediastinum",
    "Cardiomegaly",
    "Lung Lesion",
    "Lung Opacity",
    "Edema",
    "Consolidation",
    "Pneumonia",
    "Atelectasis",
    "Pneumothorax",
    "Pleural Effusion",
    "Pleural Other",
    "Fracture",
    "Support Devices",
)
# The five-observation subset that CheXpert-F1 papers also report.
FIVE: tuple[str, ...] = ("Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Pleural Effusion")
# What "No Finding" looks at: a device is not a finding.
PATHOLOGIES: tuple[str, ...] = tuple(o for o in OBSERVATIONS if o not in ("No Finding", "Support Devices"))

_EC, _CM = "Enlarged Cardiomediastinum", "Cardiomegaly"

# ---------------------------------------------------------------- mention phrases
# Regular expressions over lower-cased text with single spaces; each is matched as
# whole words. Where phrases overlap at one position the longer is tried first.
_OPACITY = r"opacit(?:y|ies)"
_DENSITY = r"densit(?:y|ies)"
MENTIONS: dict[str, tuple[str, ...]] = {
    _EC: (
        r"widen(?:ed|ing)(?: of)?(?: the)?(?: superior)? (?:cardio)?mediastin(?:um|al (?:silhouette|contours?|shadow))",
        r"enlarge(?:d|ment of the)(?: superior)? (?:cardio)?mediastin(?:um|al (?:silhouette|contours?|shadow))",
        r"(?:wide|prominent) (?:superior )?mediastinum",
        r"(?:cardio)?mediastinal (?:widening|enlargement)",
        r"prominence of the (?:superior )?mediastinum",
    ),
    _CM: (
        r"cardiomegaly",
        r"cardiac enlargement",
        r"(?:heart|cardiac silhouette) enlargement",
        r"enlarge(?:d|ment of the) (?:heart|cardiac (?:silhouette|contours?|shadow|size))",
        r"(?:enlarged|increased) (?:heart|cardiac) size",
        r"large heart",
        r"increase in (?:the )?(?:heart|cardiac) size",
    ),
    "Lung Lesion": (
        r"(?:pulmonary |lung )?nodules?",
        r"mass(?:es)?",
        r"lesions?",
        r"tumou?rs?",
        r"neoplasms?",
        r"(?:bronchogenic |bronchoalveolar )?carcinoma",
        r"(?:lung )?cancer",
        r"malignanc(?:y|ies)",
        r"metastas[ie]s",
        r"metastatic (?:disease|lesions?|deposits?|foci)",
        r"cavitation",
    ),
    "Lung Opacity": (
        _OPACITY,
        r"opacification",
        r"opacified",
        r"infiltrat(?:e|es|ion|ions|ive)",
        r"air[- ]?space (?:disease|" + _OPACITY + r"|process|filling)",
        r"hazy(?: " + _OPACITY + r")?",
        r"haziness",
        _DENSITY,
        r"interstitial (?:markings|" + _OPACITY
        + r"|prominence|abnormalit(?:y|ies)|pattern|process|changes?|disease|lung disease)",
        r"(?:increased|prominent|coarse(?:ned)?) (?:interstitial |lung |pulmonary |bronchovascular )?markings",
        r"reticul(?:ar|onodular) (?:" + _OPACITY + r"|" + _DENSITY + r"|markings|pattern|changes?)",
        r"ground[- ]glass(?: " + _OPACITY + r"| opacification)?",
        r"ggos?",
    ),
    "Edema": (
        r"(?:pulmonary |interstitial |alveolar |perihilar |airspace |mild |frank )?edema",
        r"edematous",
        r"(?:pulmonary )?(?:vascular|venous) (?:congestion|engorgement|re-?distribution|plethora)",
        r"pulmonary congestion",
        r"cephalization",
        r"(?:congestive )?heart failure",
        r"chf",
        r"(?:fluid|volume) overload",
        r"engorged (?:pulmonary )?(?:vessels|vasculature)",
        r"(?:prominent|engorged|indistinct) (?:pulmonary )?vascular(?:ity|ture|markings)",
        r"prominence of the (?:pulmonary )?vasculature",
        # Septal (Kerley) lines are interstitial fluid; matching them also keeps
        # "lines" from being read as a device.
        r"kerley(?: b)? lines?",
        r"septal lines",
    ),
    "Consolidation": (
        r"consolidat(?:ion|ions|ed|ing|ive process)",
        r"consolidative changes?",
    ),
    "Pneumonia": (
        r"(?:broncho)?pneumonias?",
        r"pneumonic",
        r"infections?",
        r"infectious(?: process| etiology| disease| infiltrates?)?",
        r"infected",
        r"pna",
    ),
    "Atelectasis": (
        r"atelecta(?:sis|ses|tic)(?: changes?)?",
        r"collapsed?",
    ),
    "Pneumothorax": (
        r"pneumothora(?:x|xes|ces)",
        r"ptx",
    ),
    "Pleural Effusion": (
        r"(?:pleural )?effusions?",
        r"pleural fluid",
        r"(?:hydro|hemo)thora(?:x|ces)",
        r"(?:blunting|blunted)(?: of)?(?: the| both)?(?: left| right| bilateral| posterior)? "
        r"(?:costophrenic|cp) (?:angles?|sulcus|sulci|recess(?:es)?)",
        r"(?:costophrenic|cp) (?:angle |sulcus )?blunting",
        r"layering (?:pleural )?fluid",
    ),
    "Pleural Other": (
        r"pleural (?:thickening|scarring|scar|plaques?|calcifications?)",
        r"thickening of the (?:pleura|pleural surfaces?)",
        r"fibrothorax",
        r"pleuro-?parenchymal (?:scarring|thickening|changes?)",
        r"pleural[- ]parenchymal (?:scarring|thickening|changes?)",
        r"apical (?:pleural )?cap(?:ping|s)?",
    ),
    "Fracture": (
        r"fractures?",
        r"fractured",
        r"fx",
    ),
    "Support Devices": (
        r"(?:support |monitoring |medical )?devices?",
        r"(?:endotracheal|tracheostomy|trach|nasogastric|orogastric|enteric|feeding|gastric|chest|ng|og|et|"
        r"dobb?hoff|nasoenteric|pigtail|thoracostomy|drainage|gastrostomy) tubes?",
        r"tubes?",
        r"ett|ngt|ogt|endotracheal|tracheostomy|nasogastric|orogastric|dobb?hoff",
        r"lines?",
        r"catheters?",
        r"picc|cvc|cvl|swan[- ]ganz|port[- ]?a[- ]?cath|portacath|mediport|port",
        r"pacemakers?|pacers?|aicd|icd|ppm|defibrillators?",
        r"(?:pacer|pacing|pacemaker|defibrillator|icd|ecg|ekg|monitoring|epicardial|transvenous) (?:leads?|wires?)",
        r"wires?",
        r"clips?",
        r"staples",
        r"stents?",
        r"hardware",
        r"drains?",
        r"coils?",
        r"cannula(?:s|e)?",
        r"sheath",
        r"introducer",
        r"electrodes?",
        r"valve (?:replacement|prosthesis)",
        r"(?:prosthetic|mechanical|bioprosthetic|artificial)(?: aortic| mitral| tricuspid| pulmonic)? valves?",
        r"avr|mvr|tavr|tavi",
        r"(?:intra-?aortic )?balloon pump|iabp",
        r"lvad|impella|ecmo",
        r"loop recorder",
        r"pleurx",
        r"ij",
    ),
}

# Phrases that name two observations at once.
SHARED_MENTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"hydropneumothora(?:x|ces)", ("Pneumothorax", "Pleural Effusion")),
    (r"consolidative " + _OPACITY, ("Consolidation", "Lung Opacity")),
    (r"nodular (?:" + _OPACITY + r"|" + _DENSITY + r")", ("Lung Lesion", "Lung Opacity")),
)

# Phrases that contain a mention word but are not one: matched first, then ignored.
LOOK_ALIKES: tuple[str, ...] = (
    r"pericardial effusions?",
    r"(?:joint|knee|shoulder|glenohumeral|subacromial) effusions?",
    r"(?:soft tissue|subcutaneous|chest wall|extremity|peripheral|scrotal|upper extremity|lower extremity) edema",
    r"(?:pleural|skin|azygo-?esophageal|paraspinal|paratracheal|junction|fissure|fissural|mach) lines?",
    r"skin folds?",
    r"mass effect",
    r"(?:bone|bone mineral|mineral|soft tissue) densit(?:y|ies)",
    r"(?:lytic|blastic|sclerotic|osseous|bony|bone|skin|cutaneous|soft tissue|breast|liver|hepatic|renal|adrenal|"
    r"thyroid|vertebral|spinal) (?:lesions?|mass(?:es)?|nodules?)",
    r"nipple shadows?",
    r"vertebral(?: body)? collapse",
    r"e\.g\.|i\.e\.",
)

# Statements: a subject, up to four linking words, and a predicate. The predicate
# gives the polarity; negation or hedging words among the linking words change it
# (see _statement_label), and cues outside the statement do not reach it.
_LINK = (
    r"(?: (?:is|are|was|were|appears?|remains?|seems?|looks?|now|again|still|stably|currently|overall|"
    r"mildly|slightly|moderately|markedly|severely|significantly|minimally|somewhat|substantially|"
    r"likely|possibly|probably|questionably|may|might|could|be|not|no|longer|grossly|also|unchanged and)){0,4}"
)
_BIG_HEART = r"(?:enlarged|increased|large|enlarging|increasing)"
_WIDE = r"(?:widened|wide|enlarged|prominent|increased|widening|enlarging|broadened)"
_NORMAL = (
    r"(?:(?:of |at |in )?(?:the )?(?:top|upper|high)[- ](?:limits? of )?normal(?: limits)?(?: in size| size)?"
    r"|(?:of )?normal(?: in size| size|-sized| sized)?|within (?:the )?normal limits|unremarkable)"
)
_BORDERLINE = r"borderline(?: (?:enlarged|large|increased|in size|size))?"
_HEART = (
    r"(?:heart(?: size)?|cardiac (?:size|silhouette|contours?|shadow|diameter)"
    r"|size of the (?:heart|cardiac silhouette))"
)
_MEDIASTINUM = (
    r"(?:superior mediastinum|mediastinum|mediastinal (?:silhouette|width|shadow)"
    r"|(?:hilar and )?mediastinal(?: and hilar)? contours?)"
)
_CARDIOMEDIASTINUM = r"(?:cardiomediastinal (?:silhouette|contours?|shadow|size))"
_BOTH = (
    r"(?:heart and mediastinum|cardiac and mediastinal (?:silhouettes?|contours?)"
    r"|mediastinal and cardiac (?:silhouettes?|contours?)|heart size and mediastinal (?:contours?|silhouette))"
)
_VESSELS = r"(?:pulmonary vascula(?:rity|ture)|pulmonary vessels|(?:pulmonary )?vascular markings)"
_ANGLES = r"(?:(?:left |right |bilateral |both |posterior )?(?:costophrenic|cp) (?:angles?|sulcus|sulci|recess(?:es)?))"

# (pattern, observations, predicate polarity: 1 enlarged/present, 0 normal, -1 borderline)
STATEMENTS: tuple[tuple[str, tuple[str, ...], int], ...] = (
    (_HEART + _LINK + " " + _BIG_HEART, (_CM,), 1),
    (_HEART + _LINK + " " + _NORMAL, (_CM,), 0),
    (_HEART + _LINK + " " + _BORDERLINE, (_CM,), -1),
    (r"(?:normal|normal-sized|normal sized|unremarkable) (?:heart(?: size)?|cardiac (?:size|silhouette|contours?|shadow))",
     (_CM,), 0),
    (r"normal size of the heart", (_CM,), 0),
    (_MEDIASTINUM + _LINK + " " + _WIDE, (_EC,), 1),
    (_MEDIASTINUM + _LINK + " " + _NORMAL, (_EC,), 0),
    (r"(?:normal|unremarkable) (?:mediastinum|mediastinal (?:silhouette|contours?))", (_EC,), 0),
    # The cardiomediastinal silhouette includes the heart: normal means both are
    # normal, enlarged names the cardiomediastinum only.
    (_CARDIOMEDIASTINUM + _LINK + " " + _WIDE, (_EC,), 1),
    (_CARDIOMEDIASTINUM + _LINK + " " + _NORMAL, (_EC, _CM), 0),
    (r"(?:normal|unremarkable) cardiomediastinal (?:silhouette|contours?|shadow|size)", (_EC, _CM), 0),
    (_BOTH + _LINK + " " + _WIDE, (_EC, _CM), 1),
    (_BOTH + _LINK + " " + _NORMAL, (_EC, _CM), 0),
    (r"normal (?:heart and mediastinum|cardiac and mediastinal (?:silhouettes?|contours?))", (_EC, _CM), 0),
    (_VESSELS + _LINK + r" (?:engorged|congested|indistinct|cephalized|prominent|increased)", ("Edema",), 1),
    (_VESSELS + _LINK + " " + _NORMAL, ("Edema",), 0),
    (r"(?:normal|unremarkable) " + _VESSELS, ("Edema",), 0),
    (_ANGLES + _LINK + r" (?:blunted|blunting|obscured)", ("Pleural Effusion",), 1),
    (_ANGLES + _LINK + r" (?:sharp|clear|preserved|normal|well[- ]defined|sharply defined)", ("Pleural Effusion",), 0),
    (r"sharp " + _ANGLES, ("Pleural Effusion",), 0),
)
_STATEMENT_NEGATORS = frozenset({"not", "no"})
_STATEMENT_HEDGES = frozenset("likely possibly probably questionably may might could".split())

# ---------------------------------------------------------------- cues
# Direction: "pre" governs the mentions after the cue, "post" the mention (list)
# before it, "both" either (forward when a mention follows it directly). "modal"
# is "both" for verbs, which reach back only when they end the statement:
# "effusion may be present", but not "opacity may be due to scarring".
_ABSOLUTELY = r"(?:entirely |completely |definitely |totally |fully |definitively |confidently )?"
_CANNOT = r"(?:cannot|can not|can't|cant|could not|does not|do not|did not)"
# Uncertainty cues that contain a negation word: matched before the negations, so
# the "not" of "cannot exclude" never negates.
NEGATED_UNCERTAINTY_CUES: tuple[tuple[str, str], ...] = (
    (_CANNOT + r" " + _ABSOLUTELY + r"(?:exclude|rule out)", "pre"),
    (r"(?:difficult|hard|impossible|not possible) to " + _ABSOLUTELY + r"(?:exclude|rule out)", "pre"),
    (_CANNOT + r" (?:be )?" + _ABSOLUTELY + r"(?:excluded|ruled out)", "post"),
    (r"not (?:be )?" + _ABSOLUTELY + r"(?:excluded|ruled out)", "post"),
)
UNCERTAINTY_CUES: tuple[tuple[str, str], ...] = (
    (r"(?:to )?(?:exclude|rule out|r/o|evaluate for|eval for|assess for|evaluation for|assessment for)", "pre"),
    (r"question of|questioned|suspicious for|suspicion (?:of|for)|concern for|concerning for|worrisome for", "pre"),
    (r"suggestive of|suggestion of|possibility of|differential (?:diagnosis )?(?:includes?|of|would include)", "pre"),
    (r"differential considerations? (?:includes?|of)|borderline", "pre"),
    (r"possible|possibly|probable|probably|likely|unlikely|questionable|questionably|suspected|suspect", "both"),
    (r"equivocal|indeterminate|presumed|presumably|presumptive|perhaps|maybe|uncertain", "both"),
    (r"suggested|concerning|worrisome", "both"),
    (r"may|might|could|suggests?|suggesting", "modal"),
)
_NO_LONGER = r"no longer"
_VISIBLE = (
    r"(?:seen|identified|present|visuali[sz]ed|visible|evident|appreciated|demonstrated|detected|noted|apparent|"
    r"observed|shown|suspected|included)"
)
NEGATION_CUES: tuple[tuple[str, str], ...] = (
    (r"not (?:definitely |clearly |convincingly |well |currently |again |definitively |readily |otherwise )?"
     + _VISIBLE, "post"),
    (_NO_LONGER + r" (?:definitely |clearly |well )?" + _VISIBLE, "post"),
    (r"ruled out|excluded|removed|removal|cleared|absent", "post"),
    (r"no (?:radiographic |definite |convincing |clear |obvious |other |further |new |acute |significant |"
     r"(?:radiographic )?signs? or )?(?:evidence|signs?|findings?|suggestion|indication)"
     r"(?: of| to suggest| suggestive of| suggesting| concerning for| for| to indicate)", "pre"),
    (r"negative for|free of|clear of|absence of|lack of|resolution of|removal of|rather than", "pre"),
    (r"without|w/o|neither|nor|none|" + _NO_LONGER + r"|no|not", "pre"),
    (r"resolved", "both"),
)

# Words that end a "pre" cue's reach: a new statement starts after them.
SCOPE_BREAKERS: tuple[str, ...] = (
    r"but|however|although|though|whereas|while|which|except|aside from|apart from|besides|other than",
    r"with|w/|there|after|following|since|status post|s/p|given",
    r"shows?|demonstrates?|reveals?|remains?|persists?|persisting|appears?|seen|noted|present|identified",
    # "no pneumothorax and stable cardiomegaly": a status word after "and" starts a positive statement.
    r"and (?:stable|unchanged|persistent|persisting|increas(?:ed|ing)|decreas(?:ed|ing)|improv(?:ed|ing)|"
    r"worsen(?:ed|ing)|redemonstrated|mild|moderate|severe|small|large|minimal|trace|new|residual)",
)
# Phrases with a negation word that negate nothing: "no change in the effusion" says
# the effusion is still there. They end a cue's reach like the breakers.
PSEUDO_NEGATIONS: tuple[str, ...] = (
    r"(?:no|without) (?:significant |appreciable |substantial |definite |major |interval |other )*"
    r"(?:change|increase|worsening|progression)(?: in| of)?",
    r"(?:no|without) (?:further|interval|additional) enlargement(?: in| of)?",
    r"not (?:significantly )?changed",
    r"(?:nearly|almost|partially|partly|largely|mostly|incompletely|not completely|not fully) resolved",
)
# Finite verbs: they end a "pre" cue's reach too, but a "post" cue reaches back over
# them ("pneumothorax is not seen").
AUXILIARIES: tuple[str, ...] = (r"is|are|was|were|has|have|had",)
# Other words a "post" cue reaches back over.
_POST_GAP_WORDS = frozenset(
    "is are was were has have had been be also now currently still again both all completely entirely fully "
    "nearly essentially definitely clearly most more very highly quite overall otherwise then since remains remain "
    "appears appear seems seem".split()
)
# What may follow a modal cue that reaches back ("effusion may be present at the
# base"): these words, then a preposition or nothing.
_MODAL_TAIL_WORDS = frozenset("be been present seen noted identified visible evident demonstrated also there".split())
_PREPOSITIONS = frozenset("at in within along on over of from throughout involving near".split())
# "A or B", "A versus B": alternatives (each uncertain unless negated).
_ALTERNATIVE_GAP = re.compile(r"[\s,]*(?:and/or|or|versus|vs\.?)(?: [a-z-]+){0,3} ?")
# How many words a list may put between two of its mentions for a "post" cue to
# reach back over both ("effusion or small apical pneumothorax is not seen").
_LIST_GAP_WORDS = 4

# ---------------------------------------------------------------- the matcher
_MENTION, _LOOK_ALIKE, _STATEMENT, _CUE, _BREAKER, _AUX, _COMMA = range(7)
_PRE, _POST, _EITHER, _MODAL = 1, 2, 3, 4
# Flags a mention collects from the cues that reach it.
_NEG, _UNC, _NEG_UNC = 1, 2, 4
_DIRECTIONS = {"pre": _PRE, "post": _POST, "both": _EITHER, "modal": _MODAL}


class _Kind:
    """What one named group of the matcher stands for."""

    __slots__ = ("kind", "observations", "polarity", "direction", "flag")

    def __init__(self, kind, observations=(), polarity=None, direction=0, flag=0):
        self.kind = kind
        self.observations = observations
        self.polarity = polarity
        self.direction = direction
        self.flag = flag


def _first_chars(parsed) -> tuple[set[str] | None, bool]:
    """The characters a parsed regex can start with (None: any), and whether it can match empty."""
    chars: set[str] = set()
    for op, av in parsed:
        name = getattr(op, "name", str(op))
        if name == "LITERAL":
            chars.add(chr(av))
            return chars, False
        if name == "IN":
            for item_op, item in av:
                item_name = getattr(item_op, "name", str(item_op))
                if item_name == "LITERAL":
                    chars.add(chr(item))
                elif item_name == "RANGE":
                    chars.update(chr(c) for c in range(item[0], item[1] + 1))
                else:
                    return None, False
            return chars, False
        if name in ("AT", "ASSERT", "ASSERT_NOT"):
            continue  # zero width
        if name == "SUBPATTERN":
            parts, least = [av[-1]], 1
        elif name == "BRANCH":
            parts, least = av[1], 1
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            parts, least = [av[2]], av[0]
        else:
            return None, False
        can_be_empty = False
        for part in parts:
            part_chars, part_empty = _first_chars(part)
            if part_chars is None:
                return None, False
            chars |= part_chars
            can_be_empty = can_be_empty or part_empty
        if least and not can_be_empty:
            return chars, False
    return chars, True


def _top_level_alternatives(pattern: str) -> list[str]:
    """``"a|b(?:c|d)"`` -> ``["a", "b(?:c|d)"]``: each alternative is dispatched and ordered on its own."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 1  # an escaped character
        elif c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
        i += 1
    parts.append(pattern[start:])
    return parts


def _build():
    # Classes in order of precedence where two phrases start at one position:
    # look-alikes before mentions, statements before mentions, pseudo-negations
    # before negations, negated uncertainty before negation. Within a class the
    # longer phrase comes first, so that "no evidence of" wins over "no".
    classes: list[list[tuple[str, _Kind]]] = [
        [(p, _Kind(_LOOK_ALIKE)) for p in LOOK_ALIKES],
        [(p, _Kind(_STATEMENT, obs, polarity)) for p, obs, polarity in STATEMENTS],
        [(p, _Kind(_MENTION, obs)) for p, obs in SHARED_MENTIONS]
        + [(p, _Kind(_MENTION, (obs,))) for obs, patterns in MENTIONS.items() for p in patterns],
        [(p, _Kind(_BREAKER)) for p in PSEUDO_NEGATIONS],
    ]
    for flag, cues in ((_NEG_UNC, NEGATED_UNCERTAINTY_CUES), (_UNC, UNCERTAINTY_CUES), (_NEG, NEGATION_CUES)):
        classes.append([(p, _Kind(_CUE, direction=_DIRECTIONS[d], flag=flag)) for p, d in cues])
    classes.append([(p, _Kind(_BREAKER)) for p in SCOPE_BREAKERS])
    classes.append([(p, _Kind(_AUX)) for p in AUXILIARIES])
    entries = [
        entry
        for c in classes
        for entry in sorted(
            [(alternative, kind) for pattern, kind in c for alternative in _top_level_alternatives(pattern)],
            key=lambda e: len(e[0]),
            reverse=True,
        )
    ]

    # One regex per first letter, holding only the phrases that can start with it:
    # trying hundreds of alternatives at every word would cost ~10x more.
    # A phrase whose first letter cannot be worked out goes into every regex.
    letters = "abcdefghijklmnopqrstuvwxyz"
    by_letter: dict[str, list[str]] = {c: [] for c in letters}
    kinds: dict[str, _Kind] = {}
    for i, (pattern, kind) in enumerate(entries):
        kinds[f"g{i}"] = kind
        try:
            chars, can_be_empty = _first_chars(_sre_parse.parse(pattern))
        except Exception:  # an unknown parser version: no dispatch for this phrase
            chars, can_be_empty = None, True
        for letter in letters if chars is None or can_be_empty else chars & set(letters):
            # The group that names the phrase goes last and is empty, so that each
            # alternative starts with its first letter, which the engine checks fast.
            by_letter[letter].append(f"{pattern}(?P<g{i}>)")
    # Each phrase ends at a word end ("no" must not match in "nodule").
    matchers = {c: re.compile("(?:" + "|".join(alts) + r")(?!\w)") for c, alts in by_letter.items() if alts}
    return matchers, kinds


_MATCHERS, _KINDS = _build()
_COMMA_KIND = _Kind(_COMMA)
# Where a phrase may start (a word start), and the punctuation that matters. A
# clause ends at a period (not a decimal point or the one of "vs."), "!", "?",
# ";", ":" and a list marker such as "2)" or "(2)".
# Each run of word characters is matched whole, so the scan never restarts inside a
# word: a run that starts with a-z is a word start (no group; the same positions as
# ``\b[a-z]``), any other run (a number, a non-ASCII word) is ``skip``. A list marker
# is tried before ``skip``, since it can start with a digit.
_TOKEN = re.compile(r"(?P<end>(?<!\bvs)[.!?](?!\d)|[;:]|(?<![^\s(])\(?\d{1,2}\)(?= ))"
                    r"|[a-z]\w*|(?P<comma>,)|(?P<skip>\w+)")
# A line break starts a new statement at a blank line, a list item or a capital
# letter; any other line break is word wrap ("no pleural effusion or\npneumothorax").
_HARD_NEWLINE = re.compile(r"\n\s*\n|\n(?=[ \t]*(?:\d{1,2}[.)][ \t]|[-*\u2022][ \t]|[A-Z]))")
_SPACE = re.compile(r"\s+")
_WORD = re.compile(r"[a-z]+")

# Report-level order: positive, then uncertain, then negative, then not mentioned.
_RANK = {None: 0, 0: 1, -1: 2, 1: 3}


def _normalise(text: str) -> str:
    if "\n" in text:  # every hard line break holds one
        text = _HARD_NEWLINE.sub(" ; ", text)
    return _SPACE.sub(" ", text.lower())


def _statement_label(kind: _Kind, phrase: str) -> int:
    polarity = kind.polarity
    words = set(_WORD.findall(phrase))
    if words & _STATEMENT_NEGATORS:
        # "not enlarged" -> 0; "not normal" -> 1; "borderline" stays uncertain.
        return {1: 0, 0: 1}.get(polarity, polarity)
    if polarity == 1 and words & _STATEMENT_HEDGES:
        return -1
    return polarity


def _label_clause(text: str, items: list, labels: dict, clause_end: int) -> None:
    """Fold the labels of one clause's mentions into ``labels``.

    ``items`` are (start, end, kind) of the clause's matches in order; the clause
    ends at ``clause_end``.
    """
    n = len(items)
    flags = [0] * n
    scope = 0  # the flag of the "pre" cue whose reach we are in, 0 outside any
    comma_in_scope = False
    for i in range(n):
        start, end, kind = items[i]
        k = kind.kind
        if k == _MENTION:
            flags[i] |= scope
        elif k == _CUE:
            direction = kind.direction
            forward = direction == _PRE or (
                direction != _POST and i + 1 < n and items[i + 1][2].kind in (_MENTION, _LOOK_ALIKE, _CUE)
            )
            if forward:
                # "no consolidation to suggest pneumonia": the negation still rules
                # the pneumonia; after a comma a hedge starts anew ("no effusion,
                # possible atelectasis").
                if not (scope == _NEG and kind.flag == _UNC and not comma_in_scope):
                    scope = kind.flag
                comma_in_scope = False
            else:
                if direction != _MODAL or _ends_statement(text, items, i, clause_end):
                    _reach_back(text, items, flags, i, kind.flag)
                scope = 0
        elif k == _COMMA:
            comma_in_scope = True
        elif k == _STATEMENT:
            label = _statement_label(kind, text[start:end])
            for observation in kind.observations:
                if _RANK[label] > _RANK[labels[observation]]:
                    labels[observation] = label
            scope = 0  # a statement has its own verb: what follows is a new statement
        elif k != _LOOK_ALIKE:  # breakers and auxiliaries
            scope = 0

    _mark_alternatives(text, items, flags)
    for i in range(n):
        start, end, kind = items[i]
        if kind.kind != _MENTION:
            continue
        f = flags[i]
        label = -1 if f & _NEG_UNC else 0 if f & _NEG else -1 if f & _UNC else 1
        for observation in kind.observations:
            if _RANK[label] > _RANK[labels[observation]]:
                labels[observation] = label


def _reach_back(text: str, items: list, flags: list, i: int, flag: int) -> None:
    """A "post" cue at item i: flag the mention (and the list of mentions) just before it."""
    j = i - 1
    # Verbs and adverbs in between are checked as words below. A comma stops the
    # search: in "left effusion, likely right effusion" the cue is about what follows.
    while j >= 0 and items[j][2].kind in (_AUX, _BREAKER):
        j -= 1
    if j < 0 or items[j][2].kind != _MENTION:
        return
    # Only auxiliaries and adverbs between: "pneumothorax has since resolved".
    if not set(_WORD.findall(text[items[j][1] : items[i][0]])) <= _POST_GAP_WORDS:
        return
    flags[j] |= flag
    while True:
        k = j - 1
        while k >= 0 and items[k][2].kind == _COMMA:
            k -= 1
        if k < 0 or items[k][2].kind != _MENTION:
            return
        if len(_WORD.findall(text[items[k][1] : items[j][0]])) > _LIST_GAP_WORDS:
            return
        flags[k] |= flag
        j = k


def _ends_statement(text: str, items: list, i: int, clause_end: int) -> bool:
    """Whether the modal cue at item i ends its statement: only words like "be present"
    follow it before a preposition, the next phrase or the clause end."""
    stop = clause_end
    for j in range(i + 1, len(items)):
        if items[j][2].kind not in (_AUX, _BREAKER):
            stop = items[j][0]
            break
    for word in _WORD.findall(text, items[i][1], stop):
        if word in _PREPOSITIONS:
            return True
        if word not in _MODAL_TAIL_WORDS:
            return False
    return True


def _mark_alternatives(text: str, items: list, flags: list) -> None:
    """Two mentions joined by "or" / "versus" name alternatives: each is uncertain, unless negated."""
    for i in range(len(items) - 1):
        a, b = items[i], items[i + 1]
        if a[2].kind != _MENTION or b[2].kind != _MENTION:
            continue
        if (flags[i] | flags[i + 1]) & _NEG:
            continue
        if _ALTERNATIVE_GAP.fullmatch(text, a[1], b[0]):
            flags[i] |= _UNC
            flags[i + 1] |= _UNC


def label_report(text: str) -> dict[str, int | None]:
    """CheXpert labels of one report: ``{observation: 1 | 0 | -1 | None}`` over ``OBSERVATIONS``.

    See the module docstring for the rules. "No Finding" is 1 when no pathology is
    positive or uncertain and None otherwise; a blank text gives all None.
    """
    if not isinstance(text, str):
        raise TypeError(f"a report must be a string, got {type(text).__name__}")
    labels: dict[str, int | None] = dict.fromkeys(OBSERVATIONS)
    if not text or text.isspace():
        return labels
    normal = _normalise(text)
    items: list = []
    has_mention = False
    reached = 0  # phrases do not overlap: skip word starts inside the last one
    matcher_of, kinds = _MATCHERS.get, _KINDS
    for token in _TOKEN.finditer(normal):
        start = token.start()
        if start < reached:
            continue
        group = token.lastgroup
        if group is None:  # a word start
            matcher = matcher_of(normal[start])
            m = matcher.match(normal, start) if matcher is not None else None
            if m is None:
                continue
            reached = m.end()
            kind = kinds[m.lastgroup]
            items.append((start, reached, kind))
            has_mention = has_mention or kind.kind in (_MENTION, _STATEMENT)
        elif group == "comma":
            items.append((start, start + 1, _COMMA_KIND))
        elif group == "skip":
            continue
        else:  # a clause ends
            if has_mention:
                _label_clause(normal, items, labels, start)
            items = []
            has_mention = False
    if has_mention:
        _label_clause(normal, items, labels, len(normal))
    if not any(labels[p] in (1, -1) for p in PATHOLOGIES):
        labels["No Finding"] = 1
    return labels


def label_reports(texts: Sequence[str]) -> list[dict[str, int | None]]:
    """``label_report`` of each text, labelling a text that repeats only once."""
    cache: dict[str, dict[str, int | None]] = {}
    out = []
    for text in texts:
        labels = cache.get(text)
        if labels is None:
            labels = cache[text] = label_report(text)
        out.append(dict(labels))
    return out
