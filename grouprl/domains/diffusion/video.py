"""Video rewards: image rewards applied to the frames of each video, aggregated per video.

A text-to-video model's sample decodes to a list of frames (``FlowModel.decode`` of a
``video`` family). ``score_videos`` scores the chosen frames of every video with an
image reward set in one call (all frames, or ``frames = k`` of them evenly spaced:
``frame_indices``) and gives each video, for each reward, the mean of its frames'
values; the weighted total is taken over those means, as for images. A frame a reward
leaves unscored (None) makes that reward's value for the video None (a mean over the
other frames would score a video on a part of it); a reward that raises fails the batch,
or under ``on_error: none`` leaves its values None, as for images.

flow_grpo's Wan OCR reward (flow_grpo/ocr.py, ``OcrScorer_video_or_image``) scores every
4th frame (``frames[::4]``; for 33 frames the 9 frames that ``frames: 9`` picks here) and
averages only the frames whose score is above 0 (0 when none is): a frame without the text
does not lower the video's score there, and does here.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from grouprl.rewards import ImageRewardSet, RewardResult
from grouprl.rewards.contract import UnscoredError, weighted_total


def frame_indices(num_frames: int, frames: int | None = None) -> list[int]:
    """The frames of a ``num_frames``-frame video that are scored: all (``frames`` None), or ``frames`` = k
    evenly spaced, round(i (F - 1) / (k - 1)) for i = 0 .. k - 1 (the first and the last among them; k = 1
    the first). ValueError when k < 1 or k > F."""
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"frame_indices: a video needs at least one frame, got {num_frames!r}")
    if frames is None:
        return list(range(num_frames))
    if isinstance(frames, bool) or not isinstance(frames, int) or not 1 <= frames <= num_frames:
        raise ValueError(f"frame_indices: frames (worker.reward.video_frames) must be an integer from 1 to the "
                         f"video's {num_frames} frames, got {frames!r}")
    if frames == 1:
        return [0]
    return [round(i * (num_frames - 1) / (frames - 1)) for i in range(frames)]


def preview_frame(video: Sequence[Any]) -> Any:
    """The frame that stands for a video in an image grid: its middle one (frame F // 2)."""
    if not video:
        raise ValueError("preview_frame: the video has no frames")
    return video[len(video) // 2]


def _mean_or_none(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else float(sum(values)) / len(values)


def score_videos(
    rewards: ImageRewardSet | Iterable[Any], videos: Sequence[Sequence[Any]], prompts: Sequence[str],
    metadata: Mapping[str, Sequence[Any]] | None = None, *, frames: int | None = None,
    allow_unscored: bool = False,
) -> RewardResult:
    """Score each video by its frames (see the module docstring): a ``RewardResult`` with a row per video.

    ``rewards``: an ``ImageRewardSet`` (or its specs). ``videos[i]`` is a list of RGB PIL frames;
    ``prompts[i]`` and each ``metadata`` column's i-th value go with every frame of video i.
    ``components[key][i]`` = mean over the scored frames of reward ``key`` (None if a frame is None);
    ``total[i]`` = sum of weight x component over the components not None at i; a video no reward
    scores is an error unless ``allow_unscored`` (its total is then None). ``parts`` are averaged as
    the components; ``logged_columns`` hold, per video, the list of its frames' values.
    """
    rewards = rewards if isinstance(rewards, ImageRewardSet) else ImageRewardSet.from_specs(rewards)
    videos, prompts = list(videos), list(prompts)
    metadata = {k: list(v) for k, v in (metadata or {}).items()}
    if len(videos) != len(prompts):
        raise ValueError(f"score_videos: got {len(prompts)} prompts for {len(videos)} videos")
    for key, values in metadata.items():
        if len(values) != len(videos):
            raise ValueError(f"score_videos: metadata {key!r} has {len(values)} values for {len(videos)} videos")
    # every scored frame a row of one image batch; owner[r] is the video of row r
    owner: list[int] = []
    images: list[Any] = []
    for i, video in enumerate(videos):
        if isinstance(video, (str, bytes)) or not hasattr(video, "__len__") or not len(video):
            raise ValueError(f"score_videos: video {i} must be a non-empty list of frames")
        for index in frame_indices(len(video), frames):
            images.append(video[index])
            owner.append(i)
    result = rewards.score(images, [prompts[i] for i in owner], {k: [v[i] for i in owner] for k, v in metadata.items()},
                           allow_unscored=True)
    rows = [[r for r, o in enumerate(owner) if o == i] for i in range(len(videos))]

    def per_video(values: list[Any]) -> list[float | None]:
        return [_mean_or_none([values[r] for r in video_rows]) for video_rows in rows]

    components = {key: per_video(values) for key, values in result.components.items()}
    total = weighted_total(components, result.weights)
    if not allow_unscored and None in total:
        video = total.index(None)
        failed = f"; failed: {', '.join(f'{k} ({e})' for k, e in result.errors.items())}" if result.errors else ""
        raise UnscoredError(f"video {video}: every image reward returned None on some of its frames "
                            f"({', '.join(rewards.keys)}){failed}; at least one reward must score every frame of "
                            "each video (or score with allow_unscored=True)", row=video)
    return RewardResult(
        components=components, total=total, weights=result.weights, errors=result.errors,
        logged_metrics=result.logged_metrics,
        logged_columns={k: [[v[r] for r in video_rows] for video_rows in rows]
                        for k, v in result.logged_columns.items()},
        parts={key: {p: per_video(v) for p, v in named.items()} for key, named in result.parts.items()},
    )
