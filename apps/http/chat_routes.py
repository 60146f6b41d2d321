"""`POST /v1/chat/completions`: vision-language chat, answered whole or streamed as server-sent events."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mmgen.apps.http.bodies import ChatBody, parse_body
from mmgen.apps.http.chat import StopText, conversation_of, stop_strings
from mmgen.apps.http.errors import ApiError
from mmgen.apps.http.routes import Route, register_routes
from mmgen.apps.http.streams import END, Pull, Streamed, Timing
from mmgen.apps.requests import text as text_requests


class ChatRoutes:
    """The chat route of `Service` (a mixin: it uses the service's catalogues, admission and threads)."""

    async def chat(self, request: Request) -> Response:
        body: ChatBody = await parse_body(request, ChatBody)
        timing = Timing(self.metrics, "text")
        catalog, model = self.find("text", body.model)
        if body.n not in (None, 1):
            raise ApiError(400, f"n must be 1 (one answer per request), got {body.n}", param="n")
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise ApiError(400, "give max_completion_tokens or max_tokens, not two different budgets",
                           param="max_completion_tokens")
        stops = stop_strings(body.stop)
        budget = next((b for b in (body.max_completion_tokens, body.max_tokens) if b is not None), None)
        seed = self.seed(body.seed)
        method = body.decoding or await self.thread(catalog.default_method, model)
        ticket = self.admission.admit("text", model)  # before images and videos are decoded: the queue bounds their memory
        try:
            talk = await self.thread(conversation_of, body.messages, self.settings.max_images)
        except BaseException:
            ticket.done()
            raise
        ask = text_requests.SERVICE.parse(model=model, message=talk.message, images=talk.images, history=talk.history,
                                          history_images=talk.history_images, videos=talk.videos,
                                          history_videos=talk.history_videos, method=method, temperature=body.temperature,
                                          seed=seed, family_options=body.options)
        ask = replace(ask, max_new_tokens=budget)  # None: the server's cap, or what the model's context leaves
        checked = await self.admitted(ticket, self.checker("text", ask, catalog))
        pull = Pull(text_requests.SERVICE.stream(checked, catalog), self.limiter)
        answer = StopText(stops)
        chat_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        try:
            first = await pull.next()
        except BaseException:
            await pull.close()
            ticket.done()
            raise

        tokens: dict[str, int] = {}

        async def completion_tokens() -> int:
            """The answer's tokens, its stop token included; for a run stopped at a stop string,
            the tokens of its text through the stop string (counted by the tokenizer)."""
            if "completion" not in tokens:
                if pull.result is not None:
                    tokens["completion"] = int(pull.result.method.tokens)
                elif answer.stopped is not None:
                    tokenizer = (await self.thread(catalog.pipeline, model)).processor.tokenizer
                    ids = await self.thread(tokenizer, answer.sent + answer.stopped, add_special_tokens=False)
                    tokens["completion"] = len(ids["input_ids"])
                else:
                    tokens["completion"] = 0
            return tokens["completion"]

        async def usage() -> dict:
            # The prompt as the run saw it: the checked conversation, its images and videos (read once).
            inputs = await self.thread(checked.pipe.prepare_inputs, checked.prompt, checked.images or None,
                                       checked.videos or None)
            mask = inputs.get("attention_mask")
            prompt_tokens = int(mask.sum()) if mask is not None else int(inputs["input_ids"].shape[-1])
            completion = await completion_tokens()
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}

        def finish_reason() -> str:
            if answer.stopped is None and pull.result is not None and pull.result.method.tokens >= checked.budget:
                return "length"
            return "stop"

        async def pieces() -> AsyncIterator[str]:
            """The answer's new text as it commits, stop strings applied; closes the run at a stop."""
            item = first
            while item is not END:
                timing.first_output()
                piece = answer.feed(item.text)
                if piece:
                    yield piece
                if answer.stopped is not None:
                    await pull.close()
                    return
                item = await pull.next()
            piece = answer.feed(pull.result.method.text, final=True)
            if piece:
                yield piece

        async def cleanup() -> None:
            await pull.close()
            ticket.done()
            if pull.result is not None or answer.stopped is not None:  # an answer was made: count it
                forwards = pull.result.method.stats.forwards if pull.result is not None else None
                timing.end(await completion_tokens(), method, forwards)

        if not body.stream:
            try:
                async for _ in pieces():
                    pass
                counts = await usage()
            finally:
                await cleanup()
            return JSONResponse({"id": chat_id, "object": "chat.completion", "created": created, "model": model,
                                 "system_fingerprint": None, "seed": seed,
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.sent,
                                                                      "refusal": None},
                                              "logprobs": None, "finish_reason": finish_reason()}],
                                 "usage": counts})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def event(choices: list, **extra: Any) -> str:
            chunk = {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": model,
                     "system_fingerprint": None, "choices": choices, **extra}
            return f"data: {json.dumps(chunk)}\n\n"

        async def events() -> AsyncIterator[str]:
            try:
                yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
                async for piece in pieces():
                    yield event([{"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}])
                yield event([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason()}])
                if include_usage:
                    yield event([], usage=await usage())
                yield "data: [DONE]\n\n"
            except Exception as error:  # the stream has begun: the error goes in it, as one event
                yield f"data: {json.dumps(self.stream_error(error))}\n\n"

        return Streamed(events(), cleanup, media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})



register_routes("text", Route("POST", "/v1/chat/completions", ChatRoutes.chat))
