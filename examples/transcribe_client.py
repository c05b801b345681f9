"""Speech to text with MiniCPM-o 4.5 through the stock OpenAI SDK (``/v1/audio/transcriptions`` and
``/v1/audio/translations``).

Start the server first (``minicpmo-serve``), then::

    python examples/transcribe_client.py speech.wav
    python examples/transcribe_client.py speech.mp3 --format verbose_json
    python examples/transcribe_client.py lecture.flac --format srt > lecture.srt
    python examples/transcribe_client.py speech.wav --stream
    python examples/transcribe_client.py chinese.wav --translate

Any file PyAV or soundfile can decode is accepted; long files are cut at pauses into windows of at most
30 s (each one a timed segment of verbose_json / srt / vtt). ``--translate`` answers in English.
"""

from __future__ import annotations

import argparse
import json
import sys

MODEL = "openbmb/MiniCPM-o-4_5"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="the audio file")
    p.add_argument("--base-url", default="http://127.0.0.1:8099/v1")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--format", default="json", choices=["json", "text", "srt", "vtt", "verbose_json"])
    p.add_argument("--language", default=None, help="ISO-639-1 language of the audio (e.g. en, zh)")
    p.add_argument("--prompt", default=None, help="context for the transcript (names, spelling)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stream", action="store_true", help="print the text as it is written")
    p.add_argument("--translate", action="store_true", help="translate into English instead")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from openai import OpenAI

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    common = {"model": args.model, "temperature": args.temperature}
    if args.prompt:
        common["prompt"] = args.prompt
    with open(args.file, "rb") as audio:
        if args.translate:
            result = client.audio.translations.create(file=audio, response_format=args.format, **common)
        elif args.stream:
            extra = {"language": args.language} if args.language else {}
            events = client.audio.transcriptions.create(file=audio, stream=True, **common, **extra)
            for event in events:
                if event.type == "transcript.text.delta":
                    print(event.delta, end="", flush=True)
            print()
            return 0
        else:
            extra = {"language": args.language} if args.language else {}
            result = client.audio.transcriptions.create(
                file=audio, response_format=args.format, **common, **extra
            )
    if isinstance(result, str):
        print(result, end="" if result.endswith("\n") else "\n")
    elif args.format == "verbose_json":
        print(json.dumps(result.model_dump(), indent=1, ensure_ascii=False))
    else:
        print(result.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
