"""`POST /v1/audio/speech`: speech streamed as its frames decode (WAV or raw PCM16)."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from mmgen.apps.http.bodies import SpeechBody, check_plain_fields, parse_body
from mmgen.apps.http.encoders import decode_base64, pcm16, wav_header
from mmgen.apps.http.errors import ApiError
from mmgen.apps.http.routes import Route, register_routes
from mmgen.apps.http.streams import END, Pull, Streamed, Timing
from mmgen.apps.requests import speech
from mmgen.apps.requests.bounds import LIMITS, shown


class SpeechRoutes:
    """The speech route of `Service` (a mixin: it uses the service's catalogues, admission and threads)."""

    async def speech(self, request: Request) -> Response:
        body: SpeechBody = await parse_body(request, SpeechBody)
        check_plain_fields(body, "input", "voice_text")
        timing = Timing(self.metrics, "speech")
        catalog, model = self.find("speech", body.model)
        kind = body.response_format or "wav"
        if kind not in ("wav", "pcm"):
            raise ApiError(400, f"response_format must be wav or pcm (uncompressed audio, streamed as it is made), got "
                                f"{shown(kind)}", param="response_format", code="unsupported_value")
        if body.stream_format not in (None, "audio"):
            raise ApiError(400, f"stream_format must be audio (the body streams as frames decode), got "
                                f"{shown(body.stream_format)}", param="stream_format")
        if body.speed not in (None, 1.0):
            raise ApiError(400, f"speed must be 1.0: this server does not change the speed of speech, got {body.speed:g}",
                           param="speed")
        if body.voice not in (None, "default"):
            raise ApiError(400, f"voice {shown(body.voice)}: this server's speech models have no named voices; leave it "
                                "out (or 'default'), or give a voice prompt as voice_audio (base64 audio) with voice_text",
                           param="voice")
        voice = None if body.voice_audio is None else decode_base64(body.voice_audio, "voice_audio", "voice_audio",
                                                                    LIMITS.upload_bytes)
        limits = await self.thread(speech.sampling_defaults, catalog, model)
        budget = body.max_new_frames
        if budget is None:
            budget = max(1, min(self.settings.max_new_frames, int(limits["max_new_frames"])))
        seed = self.seed(body.seed)
        method = body.decoding or await self.thread(catalog.default_method, model)
        ask = speech.SERVICE.parse(model=model, text=body.input, voice=voice, voice_text=body.voice_text, method=method,
                                   max_new_frames=budget, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                   seed=seed, family_options=body.options)
        ticket = self.admission.admit("speech", model)
        checked = await self.admitted(ticket, self.checker("speech", ask, catalog))
        pull = Pull(speech.SERVICE.stream(checked, catalog), self.limiter)
        try:
            first = await pull.next()
            rate = int(first.sampling_rate if first is not END else catalog.pipeline(model).sampling_rate)
        except BaseException:
            await pull.close()
            ticket.done()
            raise

        async def audio() -> AsyncIterator[bytes]:
            if kind == "wav":
                yield wav_header(rate)
            item = first
            try:
                while item is not END:
                    timing.first_output()
                    yield pcm16(item.chunk)
                    item = await pull.next()
            except Exception as error:  # the status is sent: the body ends short, the log says why
                self.stream_error(error)

        async def cleanup() -> None:
            await pull.close()
            ticket.done()
            if pull.result is not None:  # the utterance was made (a client that left is not timed)
                run = pull.result.method
                timing.end(run.units, method, run.stats.forwards)

        media = "audio/wav" if kind == "wav" else "audio/pcm"
        headers = {"X-Sample-Rate": str(rate), "X-Seed": str(seed), "Cache-Control": "no-cache"}
        return Streamed(audio(), cleanup, media_type=media, headers=headers)



register_routes("speech", Route("POST", "/v1/audio/speech", SpeechRoutes.speech))
