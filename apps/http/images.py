"""`POST /v1/images/generations`: images of a class (class-conditional models) or of a prompt
(text-to-image models), as base64 PNGs."""

from __future__ import annotations

import json
import re
import time
from typing import Any, Mapping, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse

from mmgen.apps.http.bodies import ImageBody, parse_body
from mmgen.apps.http.encoders import png_base64
from mmgen.apps.http.errors import ApiError
from mmgen.apps.http.routes import Route, register_routes
from mmgen.apps.http.streams import Timing
from mmgen.apps.requests import image
from mmgen.apps.requests.bounds import shown
from mmgen.apps.requests.runs import finish


def decoding_of(method: Optional[str], options: Union[None, str, Mapping[str, Any]]) -> tuple[Optional[str], str]:
    """A method name and its options text ("window=8,adapt=false"), from `decoding` ("sjd" or
    "sjd:window=8") and `decoding_options` (text, or an object of numbers, booleans, nulls and
    companion model names)."""
    text = ""
    if isinstance(options, Mapping):
        pieces = []
        for key, value in options.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ApiError(400, f"decoding_options: {shown(key)} is not an option name", param="decoding_options")
            shown_value = json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)
            if isinstance(value, str) and (not value or re.search(r"[,=:\s]", value)):
                raise ApiError(400, f"decoding_options.{key}: {shown(value)} is not a model name", param="decoding_options")
            pieces.append(f"{key}={shown_value}")
        text = ",".join(pieces)
    elif isinstance(options, str):
        text = options
    if method is not None and ":" in method:
        if text:
            raise ApiError(400, "give decoding options either after the method (decoding='sjd:window=8') or in "
                                "decoding_options, not both", param="decoding")
        method, text = method.split(":", 1)
    return method, text



class ImageRoutes:
    """The image route of `Service` (a mixin: it uses the service's catalogues, admission and threads)."""

    async def images(self, request: Request) -> JSONResponse:
        body: ImageBody = await parse_body(request, ImageBody)
        timing = Timing(self.metrics, "image")
        catalog, model = self.find("image", body.model)
        if body.response_format not in (None, "b64_json"):
            reason = "this server hosts no files" if body.response_format == "url" else "the one format offered"
            raise ApiError(400, f"response_format must be b64_json ({reason}), got {shown(body.response_format)}",
                           param="response_format", code="unsupported_value")
        if body.output_format not in (None, "png"):
            raise ApiError(400, f"output_format must be png, got {shown(body.output_format)}", param="output_format")
        pipe = await self.thread(catalog.main_pipeline, model)
        info = image.model_info(pipe)
        side = getattr(pipe, "image_size", None)  # a family that does not say its size (a plugin's) takes auto only
        size = None if side is None else f"{int(side)}x{int(side)}"
        if body.size not in (None, "auto", size):
            said = f"{size} (the model's) or auto" if size else "auto (this model does not say its size)"
            raise ApiError(400, f"size must be {said}, got {shown(body.size)}", param="size")
        method, options = decoding_of(body.decoding, body.decoding_options)
        seed = self.seed(body.seed)
        condition = self._condition(body, pipe.conditions, info.class_names)
        ask = image.SERVICE.parse(model=model, **condition, method=method or await self.thread(catalog.default_method, model),
                                  options=options, seed=seed, num_images=body.n, guidance_scale=body.guidance_scale,
                                  temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, num_steps=body.num_steps,
                                  family_options=body.options)
        limit = self.settings.max_images
        rows = body.n if 1 <= body.n <= limit else 1
        ticket = self.admission.admit("image", model, rows)
        checked = await self.admitted(ticket, self.checker("image", ask, catalog))
        try:
            result = await self.thread(finish, image.SERVICE.stream(checked, catalog))
            data = await self.thread(lambda: [{"b64_json": png_base64(p), "revised_prompt": None} for p in result.method.images])
        finally:
            ticket.done()
        run = result.method
        timing.end(run.units, ask.method, run.stats.forwards)
        return JSONResponse({"created": int(time.time()), "data": data, "output_format": "png",
                             "size": size or "{}x{}".format(*result.method.images[0].size),
                             "seed": seed})

    @classmethod
    def _condition(cls, body: ImageBody, conditions: str, names: list[str]) -> dict:
        """What the image is of: the prompt of a text-to-image model, the class of a
        class-conditional one (`_class_name`)."""
        if conditions != "prompt":
            return {"class_name": cls._class_name(body, names)}
        if body.class_label is not None:
            raise ApiError(400, "this model draws what the prompt says; it has no classes", param="class_label")
        if not isinstance(body.prompt, str) or not body.prompt.strip():
            raise ApiError(400, "prompt must say what to draw", param="prompt")
        return {"prompt": body.prompt}

    @staticmethod
    def _class_name(body: ImageBody, names: list[str]) -> Any:
        """The class a request names: `class_label` (an index or a name) or the prompt (a class
        name; case, spaces and underscores aside); the request layer refuses an unknown one."""
        given = body.class_label
        if isinstance(given, int):
            if not 0 <= given < len(names):
                raise ApiError(400, f"class_label must be in [0, {len(names)}), got {given}", param="class_label")
            given = names[given]
        prompt = body.prompt.strip() if isinstance(body.prompt, str) else None
        if prompt and given is not None and prompt != given:
            raise ApiError(400, "give the class as prompt or as class_label, not two different ones", param="class_label")
        if given is not None:
            return given
        if not prompt:
            raise ApiError(400, "prompt must name one of the model's classes (or give class_label)", param="prompt")
        if prompt in names:
            return prompt
        folded = re.sub(r"[\s_]+", "-", prompt.lower())
        return folded if folded in names else prompt



register_routes("image", Route("POST", "/v1/images/generations", ImageRoutes.images))
