// The page's calls to its own server: GET /v1/models and a streamed POST /v1/chat/completions
// (fetch + ReadableStream, server-sent events parsed here). The API key, when set, goes as
// "Authorization: Bearer KEY". A failed call throws an Error whose message is the server's
// own error message (OpenAI's JSON: {"error": {"message": ...}}).

function headers(apiKey) {
  const h = { "Content-Type": "application/json" };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = `${response.status}: ${body.error.message}`;
  } catch (_) { /* not JSON: keep the status line */ }
  const error = new Error(message);
  error.status = response.status;  // the server refused the request (a 400 for a refused image, ...)
  return error;
}

// The served models (GET /v1/models' "data" entries: id, max_model_len and, from servers
// that have them, capabilities, quantization, random_weights), in the server's order.
export async function listModels(apiKey) {
  const response = await fetch("/v1/models", { headers: headers(apiKey) });
  if (!response.ok) throw await failure(response);
  return (await response.json()).data;
}

// The attachment kinds ("image", "video") the model card's "capabilities" list names; a card
// without the list (an older server, or no model known yet) takes both, as before.
export function mediaKinds(card) {
  const caps = card && card.capabilities;
  return ["image", "video"].filter((k) => !Array.isArray(caps) || caps.includes(k));
}

// Each "data: ..." payload of an SSE byte stream, as text, until "[DONE]" or the end.
async function* sseData(body, signal) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data === "[DONE]") return;
        if (data) yield data;
      }
    }
  } finally {
    if (signal && signal.aborted) reader.cancel().catch(() => {});
  }
}

// Stream one chat completion. `body` is the request (stream is set here); `onDelta(delta)`
// gets each choices[0].delta (content, reasoning_content, tool_calls) and `onUsage(usage)`
// each usage: the running counts on every chunk (continuous_usage_stats, so that a stopped
// answer has its count), then the final usage. Resolves to the finish_reason; rejects with the server's error message,
// or with an AbortError when `signal` aborts.
export async function streamChat(body, apiKey, signal, onDelta, onUsage) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(apiKey), signal,
    body: JSON.stringify({ ...body, stream: true,
                           stream_options: { include_usage: true, continuous_usage_stats: true } }),
  });
  if (!response.ok) throw await failure(response);
  let finish = null;
  for await (const data of sseData(response.body, signal)) {
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
    if (chunk.usage) onUsage(chunk.usage);
    for (const choice of chunk.choices || []) {
      if (choice.delta) onDelta(choice.delta);
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  }
  return finish;
}
