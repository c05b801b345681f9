"""Text to speech with MiniCPM-o 4.5 through the stock OpenAI SDK (``/v1/audio/speech``).

Start the server first (``minicpmo-serve``), then::

    python examples/speech_client.py "Hello! This is MiniCPM-o reading text aloud." --output hello.mp3
    python examples/speech_client.py "Faster, in WAV." --format wav --speed 1.5 --output fast.wav
    python examples/speech_client.py "In my voice." --register-voice me --voice-clip me.wav --voice me

The text is spoken exactly as written; ``--voice`` takes ``default``, any OpenAI voice name (they all
speak with the default voice) or a voice registered with ``--register-voice`` (POST /v1/audio/voices:
a 1-30 s clip, featurised once and kept by the server). The audio streams to ``--output`` as it arrives
and the time to the first byte is printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

MODEL = "openbmb/MiniCPM-o-4_5"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", nargs="?", default="Hello! This is MiniCPM-o reading text aloud.")
    p.add_argument("--base-url", default="http://127.0.0.1:8099/v1")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--voice", default="default", help="default, an OpenAI voice name or a registered voice")
    p.add_argument("--format", default="mp3", choices=["mp3", "opus", "aac", "flac", "wav", "pcm"])
    p.add_argument("--speed", type=float, default=1.0, help="0.25-4.0; pitch is kept")
    p.add_argument("--instructions", default=None, help="speaking style (a system message for the model)")
    p.add_argument("--output", default=None, help="where to write the audio (default speech.<format>)")
    p.add_argument(
        "--register-voice", default=None, metavar="NAME", help="register --voice-clip as NAME first"
    )
    p.add_argument("--voice-clip", default=None, help="a 1-30 s reference clip for --register-voice")
    p.add_argument("--list-voices", action="store_true", help="print the server's voices and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from openai import OpenAI

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    if args.list_voices:
        for voice in client.get("/audio/voices", cast_to=dict)["data"]:
            print(f"{voice['name']:<16} {voice['type']}")
        return 0
    if args.register_voice:
        if not args.voice_clip:
            print("--register-voice needs --voice-clip", file=sys.stderr)
            return 2
        with open(args.voice_clip, "rb") as clip:
            created = client.post(
                "/audio/voices",
                cast_to=dict,
                body={"name": args.register_voice},
                files={"file": (Path(args.voice_clip).name, clip)},
                options={"headers": {"Content-Type": "multipart/form-data"}},
            )
        print(f"registered voice {created['name']!r} ({created['duration_s']} s)")
    output = Path(args.output or f"speech.{args.format}")
    extra = {"instructions": args.instructions} if args.instructions else {}
    started = time.perf_counter()
    first_byte = None
    size = 0
    with (
        client.audio.speech.with_streaming_response.create(
            model=args.model,
            voice=args.voice,
            input=args.text,
            response_format=args.format,
            speed=args.speed,
            **extra,
        ) as response,
        output.open("wb") as out,
    ):
        for chunk in response.iter_bytes():
            if first_byte is None:
                first_byte = time.perf_counter() - started
            out.write(chunk)
            size += len(chunk)
    total = time.perf_counter() - started
    print(
        f"wrote {output} ({size} bytes); first byte {1000 * (first_byte or total):.0f} ms, total {total:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
