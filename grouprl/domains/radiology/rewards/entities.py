"""Rule-based entity and relation extraction in the RadGraph schema.

``extract_graph(text)`` reads a chest X-ray report into a :class:`ReportGraph`:

- entities, each a lexicon term with a label: ``ANAT-DP`` (anatomy),
  ``OBS-DP`` (observation definitely present), ``OBS-U`` (uncertain),
  ``OBS-DA`` (definitely absent);
- relations between them: ``located_at`` (observation -> anatomy), ``modify``
  (a size/severity/course word -> its observation; a laterality or position word
  -> its anatomy) and ``suggestive_of`` (observation -> the observation it may
  indicate).

It needs no weights: lexicons of anatomy, findings, diseases, devices, normal
descriptors and modifiers; negation and uncertainty cues with scopes; a few
attachment rules. The RadGraph model (a trained span extractor) is the reference
this imitates; scores built on this module say ``radgraph=rules``.

Normalisation, so that paraphrases of one report build one graph:

- lowercase, plural -> singular (``opacities`` -> ``opacity``, ``hila`` -> ``hilum``);
- adjectival forms -> their noun (``pleural`` -> ``pleura``, ``pulmonary`` ->
  ``lung``, ``cardiac`` -> ``heart``, ``enlargement`` -> ``enlarged``), so that
  "pleural effusion" and "effusion in the pleura" give the same triple;
- abbreviations expand into the entities they stand for (``LLL`` -> ``left``,
  ``lower``, ``lobe`` with two ``modify`` relations, like the words written out;
  ``PTX`` -> ``pneumothorax``; ``CP angle`` -> ``costophrenic angle``);
- one entity per word, as RadGraph annotates, except fixed compounds whose
  words mean nothing alone (``costophrenic angle``, ``cardiac silhouette``,
  ``superior vena cava``, ``endotracheal tube``).

Sentences are split the way EditGRPO's editor splits them
(``(?<=[.!?])\\s+|\\n+``, empty pieces dropped), so an entity's ``sentence`` index
points into :func:`split_sentences` of the same text.

The work is linear in the length of the report: one regex tokenisation, a
longest-match dictionary lookup per word, and scope walks capped at
``_SCOPE_LIMIT`` units, so a pathological input cannot make it quadratic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from grouprl.domains.radiology.rewards.batch_parses import batch_cached

BACKEND = "radgraph=rules"

ANAT_DP = "ANAT-DP"
OBS_DP = "OBS-DP"
OBS_U = "OBS-U"
OBS_DA = "OBS-DA"
LABELS = (ANAT_DP, OBS_DP, OBS_U, OBS_DA)
RELATION_TYPES = ("located_at", "modify", "suggestive_of")

# What an entity is, beyond its label: the knowledge graph tells devices apart and
# the RaTEScore-style score tells diseases and normal descriptors apart.
CATEGORIES = ("anatomy", "finding", "disease", "device", "normal", "modifier")


class Entity(NamedTuple):
    # NamedTuple rather than a frozen dataclass: immutable as well, and several times
    # cheaper to build, which matters at ~30 entities per report per reward call.
    id: int
    text: str  # normalised: lowercase, singular, abbreviations expanded
    label: str  # one of LABELS
    sentence: int  # index into split_sentences(text)
    start: int  # character span in the original text
    end: int
    category: str  # one of CATEGORIES

    @property
    def tokens(self) -> tuple[str, ...]:
        return tuple(self.text.split())

    @property
    def span(self) -> tuple[int, int]:
        return (self.start, self.end)


class Relation(NamedTuple):
    source: int  # entity id
    target: int
    type: str  # one of RELATION_TYPES


# ``_tuple_new(Entity, fields)`` is what ``Entity(*fields)`` runs, without the generated
# ``__new__``'s Python frame: half the cost of building the ~25 entities and relations of a report.
_tuple_new = tuple.__new__


@dataclass(frozen=True)
class ReportGraph:
    """Entities and relations of one report. Immutable, so a cached graph can be shared."""

    text: str
    entities: tuple[Entity, ...]
    relations: tuple[Relation, ...]
    sentences: tuple[tuple[int, int], ...]  # character spans of split_sentences(text)

    def entity(self, entity_id: int) -> Entity:
        return self.entities[entity_id]  # ids are positions

    def relations_from(self, entity_id: int) -> list[Relation]:
        return [r for r in self.relations if r.source == entity_id]

    def triples(self) -> list[tuple[str, str, str]]:
        """(source text, relation type, target text) for every relation."""
        ents = self.entities
        return [(ents[r.source].text, r.type, ents[r.target].text) for r in self.relations]

    def __len__(self) -> int:
        return len(self.entities)


# ----------------------------------------------------------------------------- lexicon
# Kinds of units the phrase matcher turns words into.
_FILL, _ANAT, _POS, _OBS, _MOD, _CUE, _PREP, _COP, _AND, _ART, _ATTR, _COMMA, _BREAK, _EOS = range(14)

# Cue payload: (polarity, looks forward, backward mode, suggestive_of link strength).
_NEG, _UNC, _DEF = "neg", "unc", "def"
_NEVER, _ALWAYS, _FALLBACK, _ONE = 0, 1, 2, 3  # backward modes: _FALLBACK only when nothing follows

ANATOMY: dict[str, tuple[str, ...]] = {
    "lung": ("lung", "pulmonary", "lung parenchyma"),
    "lobe": ("lobe", "lobar"),
    "lingula": ("lingula", "lingular"),
    "base": ("base", "basilar", "basal", "basis"),
    "apex": ("apex", "apical"),
    "hilum": ("hilum", "hilus", "hilar", "hili"),
    "perihilar": ("perihilar",),
    "costophrenic angle": ("costophrenic angle", "cp angle", "costophrenic sulcus", "costophrenic recess",
                           "costophrenic"),
    "mediastinum": ("mediastinum", "mediastinal"),
    "cardiomediastinal silhouette": ("cardiomediastinal silhouette", "cardiomediastinal contour",
                                     "cardiomediastinal"),
    "heart": ("heart", "cardiac"),
    "cardiac silhouette": ("cardiac silhouette", "heart silhouette", "cardiac contour", "heart contour",
                           "cardiac shadow", "heart shadow"),
    "cardiopulmonary": ("cardiopulmonary",),
    "silhouette": ("silhouette",),
    "contour": ("contour",),
    "border": ("border", "margin"),
    "pleura": ("pleura", "pleural", "pleural space", "pleural surface"),
    "diaphragm": ("diaphragm", "diaphragmatic"),
    "hemidiaphragm": ("hemidiaphragm",),
    "rib": ("rib",),
    "bone": ("bone", "bony", "osseous", "osseous structure", "bony structure", "skeletal structure"),
    "spine": ("spine", "spinal", "vertebral column"),
    "vertebra": ("vertebra", "vertebral body", "vertebral"),
    "chest": ("chest", "thorax", "thoracic"),
    "hemithorax": ("hemithorax",),
    "retrocardiac region": ("retrocardiac region", "retrocardiac", "retrocardiac area", "retrocardiac space"),
    "aorta": ("aorta", "aortic"),
    "aortic arch": ("aortic arch",),
    "aortic knob": ("aortic knob", "aortic knuckle"),
    "trachea": ("trachea", "tracheal"),
    "carina": ("carina",),
    "bronchus": ("bronchus", "bronchial"),
    "vasculature": ("vasculature", "vascular", "vascularity", "vessel", "venous"),
    "interstitium": ("interstitium", "interstitial"),
    "airspace": ("airspace", "air space", "alveolar"),
    "parenchyma": ("parenchyma", "parenchymal"),
    "zone": ("zone",),
    "field": ("field",),
    "volume": ("volume",),
    "fissure": ("fissure",),
    "clavicle": ("clavicle",),
    "scapula": ("scapula",),
    "humerus": ("humerus", "humeral"),
    "shoulder": ("shoulder",),
    "sternum": ("sternum", "sternal"),
    "abdomen": ("abdomen", "abdominal"),
    "stomach": ("stomach", "gastric"),
    "bowel": ("bowel",),
    "soft tissue": ("soft tissue",),
    "thyroid": ("thyroid",),
    "neck": ("neck",),
    "axilla": ("axilla", "axillary"),
    "atrium": ("atrium", "atrial"),
    "ventricle": ("ventricle", "ventricular"),
    "superior vena cava": ("superior vena cava", "svc"),
    "inferior vena cava": ("inferior vena cava", "ivc"),
    "cavoatrial junction": ("cavoatrial junction", "atriocaval junction", "caval atrial junction",
                            "cavo atrial junction"),
    "internal jugular vein": ("internal jugular vein", "internal jugular", "jugular", "ij"),
    "subclavian vein": ("subclavian vein", "subclavian"),
    "brachiocephalic vein": ("brachiocephalic vein", "brachiocephalic"),
    "esophagus": ("esophagus", "esophageal"),
    "gastroesophageal junction": ("gastroesophageal junction", "ge junction"),
    "pericardium": ("pericardium", "pericardial"),
    "paratracheal": ("paratracheal",),
    "lymph node": ("lymph node",),
    "left": ("left", "left sided"),
    "right": ("right", "right sided"),
    "bilateral": ("bilateral", "bilaterally", "b l", "bilat"),
}

# Position words are anatomy only in front of anatomy ("lower lobe"); elsewhere
# ("lower lung volumes" aside) they are ordinary words.
POSITIONS: dict[str, tuple[str, ...]] = {
    "upper": ("upper",),
    "lower": ("lower",),
    "middle": ("middle",),
    "mid": ("mid",),
    "lateral": ("lateral",),
    "medial": ("medial",),
    "anterior": ("anterior",),
    "posterior": ("posterior",),
    "inferior": ("inferior",),
    "superior": ("superior",),
    "bilateral": ("both",),
}

# Abbreviations and fused words that stand for several anatomy entities.
ANATOMY_COMPOUNDS: dict[str, tuple[str, ...]] = {
    "lll": ("left", "lower", "lobe"),
    "lul": ("left", "upper", "lobe"),
    "rll": ("right", "lower", "lobe"),
    "rul": ("right", "upper", "lobe"),
    "rml": ("right", "middle", "lobe"),
    "bibasilar": ("bilateral", "base"),
    "bibasal": ("bilateral", "base"),
    "bibasally": ("bilateral", "base"),
    "biapical": ("bilateral", "apex"),
    "bihilar": ("bilateral", "hilum"),
    # "low" is an observation in "low lung volumes" but a position in "the low SVC"
    "low svc": ("lower", "superior vena cava"),
    "low superior vena cava": ("lower", "superior vena cava"),
}

FINDINGS: dict[str, tuple[str, ...]] = {
    "effusion": ("effusion",),
    "pneumothorax": ("pneumothorax", "ptx"),
    "hydropneumothorax": ("hydropneumothorax",),
    "opacity": ("opacity", "opacification", "opacified", "density"),
    "consolidation": ("consolidation", "consolidative", "consolidated"),
    "atelectasis": ("atelectasis", "atelectatic", "atelectases"),
    "edema": ("edema", "oedema", "edematous"),
    "congestion": ("congestion", "congested"),
    "cardiomegaly": ("cardiomegaly",),
    "enlarged": ("enlarged", "enlargement", "enlarging"),
    "nodule": ("nodule",),
    "mass": ("mass",),
    "lesion": ("lesion",),
    "fracture": ("fracture", "fractured", "fx"),
    "infiltrate": ("infiltrate", "infiltration"),
    "scarring": ("scarring", "scar"),
    "thickening": ("thickening", "thickened"),
    "calcification": ("calcification", "calcified", "calcific"),
    "granuloma": ("granuloma", "granulomata"),
    "blunting": ("blunting", "blunted"),
    "collapse": ("collapse", "collapsed"),
    "widening": ("widening", "widened"),
    "tortuosity": ("tortuosity", "tortuous", "unfolding", "unfolded"),
    "hyperinflation": ("hyperinflation", "hyperinflated", "hyperexpanded", "hyperexpansion", "overinflation",
                       "overinflated"),
    "pneumomediastinum": ("pneumomediastinum",),
    "pneumoperitoneum": ("pneumoperitoneum", "free air", "free intraperitoneal air"),
    "subcutaneous emphysema": ("subcutaneous emphysema", "subcutaneous air"),
    "air fluid level": ("air fluid level",),
    "hiatal hernia": ("hiatal hernia", "hiatus hernia"),
    "hernia": ("hernia",),
    "deformity": ("deformity",),
    "degenerative change": ("degenerative change", "degenerative disease", "spondylosis"),
    "elevation": ("elevation", "elevated"),
    "prominence": ("prominence", "prominent"),
    "engorgement": ("engorgement", "engorged", "distension", "distention", "distended"),
    "cephalization": ("cephalization",),
    "kyphosis": ("kyphosis",),
    "scoliosis": ("scoliosis",),
    "osteopenia": ("osteopenia",),
    "lucency": ("lucency", "lucent"),
    "air bronchogram": ("air bronchogram",),
    "bronchiectasis": ("bronchiectasis",),
    "cyst": ("cyst",),
    "cavitation": ("cavitation", "cavity", "cavitary"),
    "abnormality": ("abnormality", "abnormal"),
    "process": ("process",),
    "disease": ("disease",),
    "marking": ("marking",),
    "crowding": ("crowding",),
    "low": ("low",),
    "volume loss": ("volume loss", "loss of volume"),
    "haziness": ("haziness",),
    "obscuration": ("obscuration", "obscured", "obscuring"),
    "lymphadenopathy": ("lymphadenopathy", "adenopathy"),
    "shift": ("shift",),
    "pleural line": ("pleural line",),
    "kerley line": ("kerley b line", "kerley line"),
}

DISEASES: dict[str, tuple[str, ...]] = {
    "pneumonia": ("pneumonia", "pna", "bronchopneumonia"),
    "emphysema": ("emphysema", "emphysematous"),
    "copd": ("copd", "chronic obstructive pulmonary disease"),
    "tuberculosis": ("tuberculosis", "tb"),
    "malignancy": ("malignancy", "cancer", "carcinoma", "malignant"),
    "neoplasm": ("neoplasm", "tumor", "tumour"),
    "metastasis": ("metastasis", "metastatic disease"),
    "sarcoidosis": ("sarcoidosis",),
    "heart failure": ("heart failure", "congestive heart failure", "chf", "cardiac failure"),
    "infection": ("infection", "infectious process"),
    "aspiration": ("aspiration",),
    "bronchitis": ("bronchitis",),
    "pneumonitis": ("pneumonitis",),
    "fibrosis": ("fibrosis", "fibrotic"),
    "lymphoma": ("lymphoma",),
    "ards": ("ards", "acute respiratory distress syndrome"),
    "embolism": ("embolism", "pulmonary embolism"),
    "hypertension": ("hypertension",),
}

DEVICES: dict[str, tuple[str, ...]] = {
    "endotracheal tube": ("endotracheal tube", "et tube", "ett", "endotracheal"),
    "nasogastric tube": ("nasogastric tube", "ng tube", "ngt", "nasogastric"),
    "orogastric tube": ("orogastric tube", "og tube", "ogt", "orogastric"),
    "enteric tube": ("enteric tube",),
    "feeding tube": ("feeding tube", "dobhoff", "dobhoff tube", "dubhoff"),
    "chest tube": ("chest tube", "thoracostomy tube", "pigtail catheter"),
    "tracheostomy tube": ("tracheostomy tube", "tracheostomy", "trach tube", "trach"),
    "picc line": ("picc line", "picc", "peripherally inserted central catheter"),
    "central venous catheter": ("central venous catheter", "central line", "central venous line", "cvc",
                                "central catheter"),
    "pulmonary artery catheter": ("pulmonary artery catheter", "swan ganz catheter", "swan ganz"),
    "pacemaker": ("pacemaker", "pacer", "pacing device"),
    "defibrillator": ("defibrillator", "icd", "aicd"),
    "lead": ("lead",),
    "wire": ("wire",),
    "sternotomy wire": ("sternotomy wire",),
    "sternotomy": ("sternotomy", "median sternotomy"),
    "clip": ("clip",),
    "surgical clip": ("surgical clip",),
    "stent": ("stent",),
    "prosthetic valve": ("prosthetic valve", "valve replacement"),
    "port": ("port", "port a cath", "portacath", "mediport"),
    "drain": ("drain",),
    "catheter": ("catheter",),
    "tube": ("tube",),
    "line": ("line",),
    "support device": ("support device", "device", "monitoring device"),
    "hardware": ("hardware", "orthopedic hardware"),
    "prosthesis": ("prosthesis",),
    "ecg lead": ("ecg lead", "ekg lead", "monitoring lead", "ecg electrode", "electrode"),
    "intra aortic balloon pump": ("intra aortic balloon pump", "iabp", "balloon pump"),
}

NORMALS: dict[str, tuple[str, ...]] = {
    "normal": ("normal", "within normal limits", "within normal limit", "wnl"),
    "clear": ("clear",),
    "unremarkable": ("unremarkable",),
    "intact": ("intact",),
    "expanded": ("expanded", "well expanded"),
    "aerated": ("aerated", "well aerated"),
    "sharp": ("sharp",),
}

# Size, severity and course words: they modify the observation they belong to, and
# stand as an observation of their own when there is none ("heart size is stable").
MODIFIERS: dict[str, tuple[str, ...]] = {
    "small": ("small",),
    "tiny": ("tiny",),
    "trace": ("trace",),
    "minimal": ("minimal", "minimally"),
    "mild": ("mild", "mildly"),
    "moderate": ("moderate", "moderately"),
    "large": ("large",),
    "severe": ("severe", "severely"),
    "massive": ("massive",),
    "marked": ("marked", "markedly"),
    "extensive": ("extensive",),
    "slight": ("slight", "slightly"),
    "subtle": ("subtle",),
    "patchy": ("patchy",),
    "focal": ("focal",),
    "diffuse": ("diffuse", "diffusely"),
    "multifocal": ("multifocal",),
    "streaky": ("streaky",),
    "linear": ("linear",),
    "platelike": ("platelike", "plate like"),
    "hazy": ("hazy",),
    "faint": ("faint",),
    "new": ("new", "newly"),
    "increased": ("increased", "increasing", "increase"),
    "decreased": ("decreased", "decreasing", "decrease"),
    "worsening": ("worsening", "worsened", "worse"),
    "improved": ("improved", "improving", "improvement"),
    "persistent": ("persistent", "persistently", "persisting"),
    "residual": ("residual",),
    "chronic": ("chronic",),
    "acute": ("acute",),
    "subacute": ("subacute",),
    "early": ("early",),
    "old": ("old",),
    "healed": ("healed", "healing"),
    "recurrent": ("recurrent",),
    "resolving": ("resolving",),
    "layering": ("layering",),
    "loculated": ("loculated",),
    "borderline": ("borderline", "upper limits of normal", "upper limit of normal", "top normal",
                   "upper normal"),
    "nodular": ("nodular",),
    "reticular": ("reticular",),
    "reticulonodular": ("reticulonodular",),
    "ground glass": ("ground glass",),
    "bulky": ("bulky",),
    "partial": ("partial", "partially"),
    "complete": ("complete", "completely"),
    "dense": ("dense",),
    "confluent": ("confluent",),
    "scattered": ("scattered",),
    "multiple": ("multiple", "numerous", "several"),
    "coarse": ("coarse", "coarsened"),
}
# Course words that, standing alone, describe a normal or unchanged state.
_NORMAL_MODIFIERS: dict[str, tuple[str, ...]] = {
    "stable": ("stable", "stably"),
    "unchanged": ("unchanged",),
}

# Cues: (polarity, forward scope, backward mode, link). Longest phrase wins, so
# "not excluded" (uncertain) beats "not" (negation).
_NEG_PRE = (_NEG, True, _NEVER, None)
_NEG_POST = (_NEG, False, _ALWAYS, None)
_UNC_PRE = (_UNC, True, _FALLBACK, None)  # "possible X" and "X is possible"
_UNC_POST = (_UNC, False, _ALWAYS, None)
_MODAL = (_UNC, True, _FALLBACK, "weak")  # "may", "likely": X may be Y / X may be present
_SUGGEST_UNC = (_UNC, True, _NEVER, "strong")
_SUGGEST_DEF = (_DEF, True, _NEVER, "strong")
_VERSUS = (_UNC, True, _ONE, None)

CUES: dict[tuple, tuple[str, ...]] = {
    _NEG_PRE: ("no", "not", "without", "negative for", "free of", "absence of", "resolution of",
               "interval resolution of", "removal of", "interval removal of", "no longer", "neither",
               "no evidence of", "no signs of", "no sign of"),
    _NEG_POST: ("absent", "resolved", "removed", "ruled out", "not seen", "not identified", "not present",
                "not visualized", "not visible", "not appreciated", "not demonstrated", "not evident",
                "not detected", "not noted", "no longer seen", "no longer visualized", "no longer present",
                "no longer evident", "no longer identified", "no longer visible", "no longer appreciated",
                "no longer demonstrated"),
    _UNC_PRE: ("possible", "probable", "questionable", "question of", "suspected", "suspicion for",
               "suspicion of", "equivocal", "presumed", "cannot exclude", "can not exclude", "can t exclude",
               "cannot rule out", "can not rule out", "can t rule out", "not exclude", "difficult to exclude",
               "rule out", "r o", "differential includes", "differential diagnosis includes",
               "differential considerations include", "uncertain"),
    _UNC_POST: ("not excluded", "cannot be excluded", "can not be excluded", "can t be excluded",
                "cannot be ruled out", "can not be ruled out", "not ruled out", "not entirely excluded",
                "cannot be entirely excluded", "not completely excluded", "not be excluded"),
    _MODAL: ("may", "might", "could", "may be", "might be", "could be", "likely", "probably", "possibly",
             "most likely", "more likely", "presumably"),
    _SUGGEST_UNC: ("suggestive of", "suggesting", "suggests", "suggest", "concerning for", "concern for",
                   "worrisome for", "suspicious for", "raising concern for", "may represent",
                   "might represent", "could represent", "may reflect", "might reflect", "could reflect",
                   "may indicate", "could indicate", "may be due to", "could be due to", "may be related to",
                   "may be secondary to", "likely represents", "likely representing", "likely reflects",
                   "likely reflecting", "likely due to", "probably represents", "probably reflects",
                   "possibly representing", "possibly reflecting"),
    _SUGGEST_DEF: ("consistent with", "compatible with", "in keeping with", "indicative of", "diagnostic of",
                   "characteristic of", "represents", "represent", "representing", "reflects", "reflecting",
                   "reflective of"),
    _VERSUS: ("versus", "vs"),
}

# Phrases that look like a cue and are not one.
_PSEUDO_CUES = ("no change", "no interval change", "no significant change", "no significant interval change",
                "not changed", "not significantly changed", "without change", "without interval change",
                "not only", "to suggest", "to indicate")

_PREPOSITIONS = ("in", "at", "within", "of", "involving", "over", "overlying", "overlies", "along", "near",
                 "adjacent to", "projecting over", "projects over", "projecting at", "into", "from", "above",
                 "below", "throughout", "on", "across", "beneath", "behind", "posterior to", "anterior to",
                 "lateral to", "medial to", "in the region of", "at the level of", "at level of", "through",
                 "around", "surrounding", "abutting", "to", "extending to", "extending into", "terminating in",
                 "terminates in", "ending in", "ends in")
_COPULAS = ("is", "are", "was", "were", "be", "been", "being", "appear", "appears", "appeared", "remain",
            "remains", "remained", "seem", "seems", "has", "have", "had", "demonstrate", "demonstrates",
            "show", "shows")
# Words that sit between an anatomy word and its verb without ending the subject ("heart size is").
_ATTRIBUTES = ("size", "configuration", "caliber", "calibre", "appearance", "outline", "dimension", "width",
               "shape")
_BREAKS = ("but", "however", "although", "though", "whereas", "while", "except", "aside from", "apart from",
           ";", ":")

_IRREGULAR_PLURALS = {
    "pneumothorax": "pneumothoraces", "hemithorax": "hemithoraces", "thorax": "thoraces", "apex": "apices",
    "bronchus": "bronchi", "vertebra": "vertebrae", "scapula": "scapulae", "pleura": "pleurae",
    "hilum": "hila", "atrium": "atria", "hilus": "hili",
}


def _plural(word: str) -> str:
    if word in _IRREGULAR_PLURALS:
        return _IRREGULAR_PLURALS[word]
    if word.endswith("is"):
        return word[:-2] + "es"  # metastasis -> metastases
    if word.endswith(("s", "x", "z", "ch", "sh")):
        return word + "es"
    if word.endswith("y") and len(word) > 1 and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    if word.endswith("um"):
        return word[:-2] + "a"
    return word + "s"


def _build() -> tuple[dict[str, tuple], dict[tuple[str, ...], tuple], dict[str, int]]:
    """The phrase table: word tuple -> the unit specs ``((kind, payload), ...)`` it becomes."""
    table: dict[tuple[str, ...], tuple] = {}

    def add(phrase: str, specs: tuple, plural: bool = False) -> None:
        words = tuple(phrase.split())
        table[words] = specs
        if plural:
            table[words[:-1] + (_plural(words[-1]),)] = specs

    for canon, variants in ANATOMY.items():
        for v in variants:
            add(v, ((_ANAT, canon),), plural=True)
    for canon, abbrevs in ANATOMY_COMPOUNDS.items():
        add(canon, tuple((_ANAT, part) for part in abbrevs))
    for canon, variants in POSITIONS.items():
        for v in variants:
            add(v, ((_POS, canon),))
    for category, lexicon in (("finding", FINDINGS), ("disease", DISEASES), ("device", DEVICES),
                              ("normal", NORMALS)):
        for canon, variants in lexicon.items():
            for v in variants:
                add(v, ((_OBS, (canon, category)),), plural=category in ("finding", "device", "disease"))
    for category, lexicon in (("finding", MODIFIERS), ("normal", _NORMAL_MODIFIERS)):
        for canon, variants in lexicon.items():
            for v in variants:
                add(v, ((_MOD, (canon, category)),))
    for cue, phrases in CUES.items():
        for p in phrases:
            add(p, ((_CUE, cue),))
    for p in _PSEUDO_CUES:
        add(p, ((_FILL, p),))
    for p in _PREPOSITIONS:
        add(p, ((_PREP, p),))
    for w in _COPULAS:
        add(w, ((_COP, w),))
    for w in _ATTRIBUTES:
        add(w, ((_ATTR, w),))
    for w in _BREAKS:
        add(w, ((_BREAK, w),))
    for w in ("and", "or", "nor", "as well as"):
        add(w, ((_AND, w),))
    for w in ("the", "a", "an"):
        add(w, ((_ART, w),))
    add(",", ((_COMMA, ","),))
    # "clear of consolidation": the lungs are clear (an observation) and what follows is absent.
    add("clear of", ((_OBS, ("clear", "normal")), (_CUE, _NEG_PRE)))
    # "pleural fluid" is an effusion in the pleura, written the other way round.
    add("pleural fluid", ((_ANAT, "pleura"), (_OBS, ("effusion", "finding"))))

    singles = {words[0]: specs for words, specs in table.items() if len(words) == 1}
    longest: dict[str, int] = {}
    for words in table:
        if len(words) > 1:
            longest[words[0]] = max(longest.get(words[0], 1), len(words))
    multi = {words: specs for words, specs in table.items() if len(words) > 1}
    return singles, multi, longest


_SINGLE, _MULTI, _LONGEST = _build()
# One lookup per word: (its own specs or None, whether it starts a longer phrase).
_LEXICON: dict[str, tuple] = {w: (_SINGLE.get(w), w in _LONGEST) for w in set(_SINGLE) | set(_LONGEST)}
# The first two words of every longer phrase -> the longest phrase they start: most words
# that start a phrase ("no", "pleural") are not followed by one, and this says so in one lookup.
_PAIRS: dict[tuple[str, str], int] = {}
for _words in _MULTI:
    _PAIRS[_words[:2]] = max(_PAIRS.get(_words[:2], 0), len(_words))
del _words

_SENTENCE_BOUNDARY = re.compile(r"(?<=[.!?])\s+|\n+")  # as EditGRPO's editor splits sentences
# The stripped pieces that splitting at _SENTENCE_BOUNDARY leaves, matched directly: runs of
# non-space joined by spaces that hold no line break and follow no sentence end.
_SENTENCE = re.compile(r"\S+(?:(?<![.!?])[^\S\n]+\S+)*")
_TOKEN = re.compile(r"[a-z0-9]+|[,;:]")
_SCOPE_LIMIT = 40  # units a cue, modifier or attachment rule may look across


# ----------------------------------------------------------------------------- sentences
def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the sentences, split as EditGRPO's editor splits (empty pieces dropped)."""
    return [m.span() for m in _SENTENCE.finditer(text)]


def split_sentences(text: str) -> list[str]:
    """The sentences that ``Entity.sentence`` indexes into."""
    return [text[a:b] for a, b in sentence_spans(text)]


# ----------------------------------------------------------------------------- extraction
def extract_graph(text: str) -> ReportGraph:
    """Entities and relations of a report, by rules (see the module docstring)."""
    if not isinstance(text, str):
        raise TypeError(f"extract_graph needs a string, got {type(text).__name__}")
    low = text.lower()
    if len(low) != len(text):  # a few characters lowercase to two; keep spans aligned
        low = "".join(c.lower()[:1] for c in text)
    spans = sentence_spans(low)
    kinds, payloads, where = _units(low, spans)
    n = len(kinds)
    if n == 0:
        return ReportGraph(text, (), (), tuple(spans))

    _resolve_positions(kinds)
    group_head = _anatomy_groups(kinds)
    head = [k == _OBS for k in kinds]
    attach = _attach_modifiers(kinds, payloads, head)
    labels = _certainty(kinds, payloads, head)
    suggest = _suggestions(kinds, payloads, head)
    subject = _subjects(kinds, group_head)

    ids = [-1] * n
    entities: list[Entity] = []
    members: list[int] = []  # the units that became entities: only they take part in relations
    for i, k in enumerate(kinds):
        if k == _ANAT:
            text_i, label, category = payloads[i], ANAT_DP, "anatomy"
        elif head[i]:
            text_i, category = payloads[i]
            label = labels.get(i, OBS_DP)
        elif k == _MOD:
            text_i, label, category = payloads[i][0], labels.get(attach[i], OBS_DP), "modifier"
        else:
            continue
        ids[i] = len(entities)
        members.append(i)
        start, end, sentence = where[i]
        entities.append(_tuple_new(Entity, (len(entities), text_i, label, sentence, start, end, category)))

    relations: dict[Relation, None] = {}  # insertion-ordered set

    def relate(a: int, b: int, kind: str) -> None:
        if a != b and ids[a] >= 0 and ids[b] >= 0:
            relations[_tuple_new(Relation, (ids[a], ids[b], kind))] = None

    for i in members:
        k = kinds[i]
        if k == _ANAT:
            if group_head[i] != i:
                relate(i, group_head[i], "modify")
        elif k == _MOD and not head[i]:
            relate(i, attach[i], "modify")
        if head[i]:
            for loc in _locations(i, kinds, payloads, head, attach, group_head, subject):
                relate(i, loc, "located_at")
    for source, target in suggest:
        relate(source, target, "suggestive_of")
    return ReportGraph(text, tuple(entities), tuple(relations), tuple(spans))


@batch_cached
def graph_of(text: str) -> ReportGraph:
    """:func:`extract_graph`, cached by text: the reward components share one parse per report.

    Inside a :func:`~grouprl.domains.radiology.rewards.batch_parses.batch_scope` each distinct
    text of the batch is parsed once for all components, however large the batch.
    Outside one, and across batches, a text-keyed LRU cache of 8192 graphs (some 50 MB)
    answers: references recur across requests, and the editor and the extractor routes
    look up texts one at a time.
    """
    return _recent_graph(text)


@lru_cache(maxsize=8192)
def _recent_graph(text: str) -> ReportGraph:
    return extract_graph(text)


def _units(low: str, spans: list[tuple[int, int]]) -> tuple[list[int], list, list]:
    """Words -> units by longest phrase match, with a sentence-end unit between sentences:
    each unit's kind, its payload, and where it is, ``(start, end, sentence)`` (None for a
    filler or a sentence end, which never become entities), as three parallel lists.

    Parallel lists and one position tuple per phrase, not a tuple per unit: fewer objects
    for the garbage collector to count, at ~30 units per report.
    """
    kinds: list[int] = []
    payloads: list = []
    where: list[tuple[int, int, int] | None] = []
    add_kind, add_payload, add_where = kinds.append, payloads.append, where.append
    lexicon, multi, pairs = _LEXICON, _MULTI, _PAIRS
    findall, find = _TOKEN.findall, low.find
    # Sentence by sentence: no phrase spans a sentence end.
    for sent, (a, b) in enumerate(spans):
        if sent:
            add_kind(_EOS)
            add_payload(None)
            add_where(None)
        words = findall(low, a, b)
        n = len(words)
        pos = a  # the end of the previous word: the next word is the first place it occurs from here
        done = 0  # words before this are units already (the rest of a phrase)
        for i, w in enumerate(words):
            if i < done:
                continue
            start = find(w, pos)
            pos = start + len(w)
            entry = lexicon.get(w)
            if entry is None:
                add_kind(_FILL)
                add_payload(w)
                add_where(None)
                continue
            specs, starts_phrase = entry
            # Only a word pair that starts some phrase is worth trying phrase lengths for.
            if starts_phrase and i + 1 < n and (most := pairs.get((w, words[i + 1]))):
                for L in range(min(most, n - i), 1, -1):
                    found_specs = multi.get(tuple(words[i:i + L]))
                    if found_specs is not None:
                        specs, done = found_specs, i + L
                        for other in words[i + 1:done]:  # the phrase's other words
                            pos = find(other, pos) + len(other)
                        break
            if specs is None:
                add_kind(_FILL)
                add_payload(w)
                add_where(None)
                continue
            span = (start, pos, sent)
            for kind, payload in specs:
                add_kind(kind)
                add_payload(payload)
                add_where(span)
    return kinds, payloads, where


def _resolve_positions(kinds: list[int]) -> None:
    # Right to left, so "both lower lobes" resolves "lower" before "both".
    for i in range(len(kinds) - 1, -1, -1):
        if kinds[i] == _POS:
            kinds[i] = _ANAT if i + 1 < len(kinds) and kinds[i + 1] == _ANAT else _FILL


def _anatomy_groups(kinds: list[int]) -> list[int]:
    """For each anatomy unit, the last unit of its run ("left lower lobe" -> lobe): the head it modifies."""
    n = len(kinds)
    group_head = [-1] * n
    i = 0
    while i < n:
        if kinds[i] == _ANAT:
            j = i
            while j + 1 < n and kinds[j + 1] == _ANAT:
                j += 1
            for t in range(i, j + 1):
                group_head[t] = j
            i = j + 1
        else:
            i += 1
    return group_head


def _attach_modifiers(kinds: list[int], payloads: list, head: list[bool]) -> list[int]:
    """Each modifier's observation: the next one in its noun phrase ("small left effusion"),
    else the one it is said of ("the effusion is small"); with neither it stands alone."""
    n = len(kinds)
    attach = [-1] * n
    for i in range(n):
        if kinds[i] != _MOD:
            continue
        target = -1
        j = i + 1
        limit = min(n, i + _SCOPE_LIMIT)
        while j < limit:
            k = kinds[j]
            if k == _OBS:
                target = j
                break
            if k == _MOD or k == _ANAT or (k == _PREP and payloads[j] == "to" and j + 1 < n
                                           and kinds[j + 1] == _MOD):
                j += 1
                continue
            break
        if target < 0:
            j = i - 1
            steps = 0
            while j >= 0 and steps < 5:
                k = kinds[j]
                if k == _OBS:
                    target = j
                    break
                if k not in (_COP, _MOD, _FILL):
                    break
                j -= 1
                steps += 1
        if target >= 0:
            attach[i] = target
        else:
            head[i] = True
    return attach


def _list_continues(comma: int, kinds: list[int], head: list[bool]) -> bool:
    """Does the phrase after a comma continue a list of observations ("no X, Y, or Z")?"""
    t = comma + 1
    n = len(kinds)
    while t < n and not head[t] and kinds[t] in (_AND, _ART, _MOD, _ANAT):
        t += 1
    return t < n and head[t]


def _previous_item_is_listed(comma: int, kinds: list[int], head: list[bool]) -> bool:
    """Is the phrase before a comma a bare list item (an observation, no verb)?"""
    t = comma - 1
    found = False
    stop = max(-1, comma - _SCOPE_LIMIT)
    while t > stop and kinds[t] not in (_COMMA, _EOS, _BREAK, _CUE):
        if kinds[t] == _COP:
            return False
        found = found or head[t]
        t -= 1
    return found


def _forward_scope(c: int, kinds: list[int], head: list[bool], stop_at_verb: bool) -> list[int]:
    out = []
    n = len(kinds)
    limit = min(n, c + 1 + _SCOPE_LIMIT)
    j = c + 1
    while j < limit:
        k = kinds[j]
        if k == _EOS or k == _BREAK or k == _CUE:
            break
        # "no pneumothorax and the heart is enlarged": a new verb ends a negation
        if k == _COP and stop_at_verb:
            break
        if k == _COMMA:
            if not _list_continues(j, kinds, head):
                break
        elif head[j]:
            out.append(j)
        j += 1
    return out


def _backward_scope(c: int, kinds: list[int], head: list[bool]) -> list[int]:
    out: list[int] = []
    j = c - 1
    while j >= 0 and kinds[j] == _COP:  # the cue's own verb: "effusion [has been] removed"
        j -= 1
    and_cut = None
    stop = max(-1, c - _SCOPE_LIMIT)
    while j > stop:
        k = kinds[j]
        if k == _EOS or k == _BREAK or k == _CUE:
            break
        if k == _COP:
            # another clause's verb: "the heart is enlarged and effusion is not seen"
            if and_cut is not None:
                del out[and_cut:]
            break
        if k == _AND:
            and_cut = len(out)
        elif k == _COMMA:
            if not _previous_item_is_listed(j, kinds, head):
                break
        elif head[j]:
            out.append(j)
        j -= 1
    return out


def _nearest_before(c: int, kinds: list[int], head: list[bool]) -> int:
    j = c - 1
    stop = max(-1, c - _SCOPE_LIMIT)
    while j > stop and kinds[j] not in (_EOS, _BREAK, _COMMA, _CUE):
        if head[j]:
            return j
        j -= 1
    return -1


def _certainty(kinds: list[int], payloads: list, head: list[bool]) -> dict[int, str]:
    """Observation labels from the cues; the nearest cue wins where two reach one observation."""
    best: dict[int, tuple[int, str]] = {}
    for c, k in enumerate(kinds):
        if k != _CUE:
            continue
        polarity, forward, backward, _link = payloads[c]
        if polarity == _DEF:
            continue
        label = OBS_DA if polarity == _NEG else OBS_U
        targets = _forward_scope(c, kinds, head, polarity == _NEG) if forward else []
        if backward == _ALWAYS or (backward == _FALLBACK and not targets):
            targets = targets + _backward_scope(c, kinds, head)
        elif backward == _ONE:
            before = _nearest_before(c, kinds, head)
            if before >= 0:
                targets.append(before)
        for t in targets:
            distance = abs(t - c)
            if t not in best or distance < best[t][0]:
                best[t] = (distance, label)
    return {t: label for t, (_, label) in best.items()}


def _suggestions(kinds: list[int], payloads: list, head: list[bool]) -> list[tuple[int, int]]:
    """(source, target) unit pairs for "X suggestive of / may represent / concerning for Y"."""
    pairs = []
    for c, k in enumerate(kinds):
        if k != _CUE or payloads[c][3] is None:
            continue
        strong = payloads[c][3] == "strong"
        targets = _forward_scope(c, kinds, head, False)
        if not targets:
            continue
        source = -1
        commas = 0
        j = c - 1
        stop = max(-1, c - _SCOPE_LIMIT)
        while j > stop:
            kj = kinds[j]
            if kj == _EOS or kj == _BREAK:
                break
            if head[j]:
                source = j
                break
            # a weak cue ("likely") links only to the phrase it follows: "opacity, likely atelectasis",
            # not "cardiomegaly and likely effusion"
            if not strong:
                if kj == _AND or kj == _CUE:
                    break
                if kj == _COMMA:
                    commas += 1
                    if commas > 1:
                        break
            j -= 1
        if source >= 0:
            pairs.extend((source, t) for t in targets)
    return pairs


def _verb_ahead(i: int, kinds: list[int]) -> bool:
    t = i + 1
    limit = min(len(kinds), i + 12)
    while t < limit and kinds[t] not in (_EOS, _BREAK, _COMMA, _CUE):
        if kinds[t] == _COP:
            return True
        t += 1
    return False


def _subjects(kinds: list[int], group_head: list[int]) -> list[int]:
    """For each unit, the anatomy its clause is about ("the lungs are clear" -> lung), or -1."""
    n = len(kinds)
    subject = [-1] * n
    current = -1
    for i in range(n):
        k = kinds[i]
        if k == _EOS or k == _BREAK or k == _COMMA:
            current = -1
        elif k == _AND:
            if _verb_ahead(i, kinds):  # "... and there is ..." starts a new clause
                current = -1
        elif k == _COP and not (i > 0 and kinds[i - 1] == _COP):
            j = i - 1
            while j >= 0 and kinds[j] == _ATTR:  # "heart size is"
                j -= 1
            current = group_head[j] if j >= 0 and kinds[j] == _ANAT else -1
        subject[i] = current
    return subject


def _locations(h: int, kinds: list[int], payloads: list, head: list[bool], attach: list[int],
               group_head: list[int], subject: list[int]) -> list[int]:
    """The anatomy an observation is located at, by the first rules that apply:
    (a) anatomy right before it ("left lower lobe opacity") and (b) after a preposition
    ("opacity in the left lower lobe"); else (c) anatomy right after it ("enlarged
    heart"); else (d) the clause's subject ("the heart is enlarged")."""
    n = len(kinds)
    found = []
    j = h - 1
    while j >= 0 and kinds[j] == _MOD and attach[j] == h:
        j -= 1
    while j >= 0 and kinds[j] == _ATTR:
        j -= 1
    if j >= 0 and kinds[j] == _ANAT:
        found.append(group_head[j])
    j = h + 1
    steps = 0
    while j < n and steps < 4 and (kinds[j] in (_COP, _FILL, _ATTR) or (kinds[j] == _MOD and attach[j] == h)):
        j += 1
        steps += 1
    if j < n and kinds[j] == _PREP:
        steps = 0
        while j < n and steps < 6 and kinds[j] in (_PREP, _ART, _FILL, _ATTR):
            j += 1
            steps += 1
        if j < n and kinds[j] == _ANAT:
            found.append(group_head[j])
    if found:
        return found
    j = h + 1
    if j < n and kinds[j] == _ART:
        j += 1
    if j < n and kinds[j] == _ANAT:
        return [group_head[j]]
    if subject[h] >= 0:
        return [subject[h]]
    return []


__all__ = [
    "ANAT_DP",
    "BACKEND",
    "CATEGORIES",
    "Entity",
    "LABELS",
    "OBS_DA",
    "OBS_DP",
    "OBS_U",
    "RELATION_TYPES",
    "Relation",
    "ReportGraph",
    "extract_graph",
    "graph_of",
    "sentence_spans",
    "split_sentences",
]
