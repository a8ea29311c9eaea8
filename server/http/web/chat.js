// The chat page: streams replies from this server's own /v1/chat/completions. The conversation
// lives in this page only (nothing is stored on the server); an API key, when the server asks for
// one, is kept in this tab's sessionStorage and sent as a Bearer token, never written into the page.
"use strict";
const $ = (id) => document.getElementById(id);
const KEY_ITEM = "llm-serving-api-key";
// `chat` counts conversations: a reply still streaming when New chat starts another is aborted and
// then belongs to none (its text, stats and turn are dropped).
const state = { messages: [], model: null, controller: null, chat: 0, key: sessionStorage.getItem(KEY_ITEM) || "" };

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

function askForKey(why) {
  $("key-status").textContent = why;
  $("key-box").hidden = false;
  $("key").focus();
}

async function loadModels() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (r.status === 401) return askForKey(state.key ? "That API key was refused." : "This server needs an API key.");
  const names = (await r.json()).data.map((m) => m.id);
  state.model = names[0];
  $("model").textContent = names.join(" · ");
}

function bubble(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  el.textContent = text;
  $("transcript").append(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function number(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

function requestBody() {
  const body = { model: state.model, messages: state.messages, stream: true, stream_options: { include_usage: true },
                 temperature: number("temperature"), top_p: number("top_p"), max_tokens: number("max_tokens"),
                 seed: number("seed") };
  if ($("json_mode").checked) {
    const schema = $("schema").value.trim();
    body.response_format = schema ? { type: "json_schema", json_schema: { name: "reply", schema: JSON.parse(schema) } }
                                  : { type: "json_object" };
  }
  return body;
}

// Each `data:` event of a server-sent-events body, parsed, as it arrives.
async function* events(response) {
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ") && line !== "data: [DONE]") yield JSON.parse(line.slice(6));
      }
    }
  }
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

async function send(text) {
  let body;
  try {
    body = requestBody();
  } catch (e) {
    return bubble("assistant error", "The JSON schema is not JSON: " + e.message);
  }
  state.messages.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  const stats = document.createElement("div");
  stats.className = "stats";
  const t0 = performance.now();
  let first = null, tokens = 0, reply = "", note = "";
  const chat = state.chat, controller = (state.controller = new AbortController());
  busy(true);
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
                                                    body: JSON.stringify(body), signal: controller.signal });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      if (r.status === 401) askForKey("This server needs an API key.");
      throw new Error(`${r.status}: ${(err.error && err.error.message) || r.statusText}`);
    }
    for await (const chunk of events(r)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content;
      if (delta) {
        first = first ?? performance.now();
        reply += delta;
        out.textContent = reply;
        out.scrollIntoView({ block: "end" });
      }
    }
  } catch (e) {
    if (e.name === "AbortError") note = " · stopped";
    else {
      out.classList.add("error");
      out.textContent = reply + (reply ? "\n" : "") + e.message;
    }
  } finally {
    if (state.controller === controller) {
      busy(false);
      state.controller = null;
    }
  }
  if (chat !== state.chat) return;  // New chat came meanwhile: this reply is of no conversation now
  if (reply || note) state.messages.push({ role: "assistant", content: reply });
  else state.messages.pop();  // nothing came back: the turn is not part of the conversation
  if (first !== null) {
    const seconds = (performance.now() - first) / 1000;
    const rate = tokens > 1 && seconds > 0 ? ` · ${((tokens - 1) / seconds).toFixed(1)} tokens/s` : "";
    stats.textContent = `TTFT ${Math.round(first - t0)} ms${rate}${tokens ? ` · ${tokens} tokens` : ""}${note}`;
    $("transcript").append(stats);
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  if (state.controller) state.controller.abort();  // the server stops generating it
  state.controller = null;
  busy(false);
  state.chat += 1;
  state.messages = [];
  $("transcript").replaceChildren();
});
$("key-box").addEventListener("submit", (e) => {
  e.preventDefault();
  state.key = $("key").value.trim();
  sessionStorage.setItem(KEY_ITEM, state.key);
  $("key-box").hidden = true;
  loadModels();
});
loadModels();
