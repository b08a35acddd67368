"""Rollout videos: frames with a text overlay (the instruction, step, reward, return, SUCCESS/FAIL),
saved as mp4.

Text is drawn with Pillow's built-in default font (no font files to ship); videos are written by
imageio's ffmpeg plugin (imageio-ffmpeg ships its own ffmpeg binary).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

DEFAULT_FPS = 15
# The last frame is held this long (seconds) so the SUCCESS/FAIL banner can be read.
END_HOLD_SECONDS = 0.5

_SUCCESS_COLOR = (40, 170, 60)
_FAIL_COLOR = (200, 40, 40)
_RESULT_COLOR = (60, 60, 160)


def end_hold_frames(fps: int) -> int:
    """How many copies of the final frame close a video."""
    return max(1, round(fps * END_HOLD_SECONDS))


def resize_frame(frame: np.ndarray, height: int | None) -> np.ndarray:
    """Resize an [H, W, 3] uint8 frame to `height` rows, keeping the aspect ratio.

    Both sides are rounded to even numbers: the yuv420p pixel format players expect needs them.
    """
    h, w = frame.shape[:2]
    new_h = height if height else h
    new_w = max(2, round(w * new_h / h))
    new_h, new_w = new_h + new_h % 2, new_w + new_w % 2
    if (new_h, new_w) == (h, w):
        return frame
    return np.asarray(Image.fromarray(frame).resize((new_w, new_h), Image.Resampling.BILINEAR))


def _font(height: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    size = max(8, height // 18)
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one fixed-size bitmap font
        return ImageFont.load_default()


def draw_overlay(
    frame: np.ndarray, lines: list[str], banner: str | None = None, banner_color=_RESULT_COLOR
) -> np.ndarray:
    """Return a copy of `frame` with `lines` in the top-left corner (on a dark box) and an
    optional coloured `banner` across the bottom."""
    image = Image.fromarray(np.ascontiguousarray(frame))
    draw = ImageDraw.Draw(image, "RGBA")
    height = image.height
    font = _font(height)
    pad = max(2, height // 64)
    if lines:
        text = "\n".join(lines)
        left, top, right, bottom = draw.multiline_textbbox((pad, pad), text, font=font)
        draw.rectangle((0, 0, right + pad, bottom + pad), fill=(0, 0, 0, 150))
        draw.multiline_text((pad, pad), text, font=font, fill=(255, 255, 255))
    if banner:
        left, top, right, bottom = draw.textbbox((0, 0), banner, font=font)
        box_top = height - (bottom - top) - 3 * pad
        draw.rectangle((0, box_top, image.width, height), fill=(*banner_color, 220))
        x = max(pad, (image.width - (right - left)) // 2)
        draw.text((x, box_top + pad - top), banner, font=font, fill=(255, 255, 255))
    return np.asarray(image)


def wrap_caption(caption: str, width: int, height: int) -> list[str]:
    """`caption` (an instruction) in lines that fit a frame `width` pixels wide."""
    import textwrap

    font_width = 0.6 * max(8, height // 18)  # the default font's average glyph width, about
    return textwrap.wrap(caption, max(8, int(width / font_width) - 1))


def step_lines(step: int, reward: float | None, episode_return: float) -> list[str]:
    reward_text = "-" if reward is None else f"{reward:+.3f}"
    return [f"step {step}", f"reward {reward_text}", f"return {episode_return:.3f}"]


def result_banner(success: bool | None, episode_return: float) -> tuple[str, tuple[int, int, int]]:
    """The closing banner: SUCCESS/FAIL for tasks with a success test, the return otherwise."""
    if success is None:
        return f"RETURN {episode_return:.2f}", _RESULT_COLOR
    return ("SUCCESS", _SUCCESS_COLOR) if success else ("FAIL", _FAIL_COLOR)


def write_video(path: str | Path, frames: list[np.ndarray], fps: int = DEFAULT_FPS) -> Path:
    """Write uint8 [H, W, 3] frames to an mp4 (H.264, yuv420p) and return its path.

    Written to a temporary name and renamed, so a killed run leaves no half-written video.
    """
    import imageio.v2 as imageio

    if not frames:
        raise ValueError(f"no frames to write to {path}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    # macro_block_size=2: keep our (even) size instead of imageio's default upscale to 16s.
    writer = imageio.get_writer(
        tmp, fps=fps, codec="libx264", pixelformat="yuv420p", macro_block_size=2,
        ffmpeg_log_level="error",
    )
    try:
        for frame in frames:
            writer.append_data(frame)
    finally:
        writer.close()
    tmp.replace(path)
    return path


class EpisodeRecorder:
    """Collects the annotated frames of one episode.

    Frame t shows the state after t steps with the reward of step t and the return so far. With
    same-step auto-reset the state after the last step is never rendered (the env already shows
    the next episode), so the video closes with the last rendered state held for
    `end_hold_frames(fps)` frames under the final step's numbers and the SUCCESS/FAIL banner:
    a video has `length + end_hold_frames(fps)` frames.
    """

    def __init__(self, height: int | None = None, fps: int = DEFAULT_FPS, caption: str | None = None):
        self.height = height
        self.fps = fps
        self.caption = caption  # drawn above the step lines (the episode's instruction)
        self.frames: list[np.ndarray] = []
        self._last_image: np.ndarray | None = None

    def add(self, frame: np.ndarray, step: int, reward: float | None, episode_return: float) -> None:
        image = resize_frame(np.asarray(frame, dtype=np.uint8), self.height)
        self._last_image = image
        self.frames.append(draw_overlay(image, self._lines(image, step, reward, episode_return)))

    def _lines(self, image: np.ndarray, step: int, reward: float | None, episode_return: float) -> list[str]:
        caption = wrap_caption(self.caption, image.shape[1], image.shape[0]) if self.caption else []
        return caption + step_lines(step, reward, episode_return)

    def finish(
        self, path: str | Path, step: int, reward: float, episode_return: float, success: bool | None
    ) -> Path:
        if self._last_image is None:
            raise ValueError("EpisodeRecorder.finish called before any frame was added")
        banner, color = result_banner(success, episode_return)
        lines = self._lines(self._last_image, step, reward, episode_return)
        last = draw_overlay(self._last_image, lines, banner, color)
        frames = self.frames + [last] * end_hold_frames(self.fps)
        return write_video(path, frames, self.fps)
