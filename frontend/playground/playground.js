// The playground page: chat with streamed replies through /v1/chat/completions
// and the model picker from /v1/models (the /metrics panel: live_metrics.js).
// The API key (when the server has --api-key) lives in sessionStorage: this tab only.
"use strict";

const KEY_STORAGE = "pagedserve.apiKey";
const $ = (id) => document.getElementById(id);

const chat = {messages: [], controller: null};

function apiHeaders() {
  const headers = {"Content-Type": "application/json"};
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

// The server's error, as it sent it: "HTTP 401: <message>" from the OpenAI error shape, else the raw body.
async function errorText(response) {
  const body = await response.text();
  let message = body;
  try {
    const parsed = JSON.parse(body);
    if (parsed && parsed.error && parsed.error.message) message = parsed.error.message;
  } catch (e) { /* not JSON: show the body as it is */ }
  return "HTTP " + response.status + (response.statusText ? " " + response.statusText : "") + ": " + message;
}

function showNotice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

function askForKey(reason) {
  $("key-reason").textContent = reason;
  $("key-form").hidden = false;
  $("api-key").focus();
}

async function loadModels() {
  let response;
  try {
    response = await fetch("/v1/models", {headers: apiHeaders()});
  } catch (e) {
    showNotice("Cannot reach the server: " + e.message);
    return;
  }
  if (response.status === 401) {
    const had = sessionStorage.getItem(KEY_STORAGE);
    askForKey((had ? "That key was refused. " : "This server needs an API key. ") + await errorText(response));
    return;
  }
  if (!response.ok) {
    showNotice(await errorText(response));
    return;
  }
  const models = (await response.json()).data || [];
  const select = $("model");
  const previous = select.value;
  select.replaceChildren(...models.map((model) => new Option(model.id, model.id)));
  if (models.some((model) => model.id === previous)) select.value = previous;
  $("key-form").hidden = true;
  showNotice("");
}

function addBubble(role, text) {
  const bubble = document.createElement("div");
  bubble.className = "message " + role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  bubble.append(content);
  $("messages").append(bubble);
  bubble.scrollIntoView({block: "end"});
  return bubble;
}

function requestBody() {
  const system = $("system").value.trim();
  const messages = (system ? [{role: "system", content: system}] : []).concat(chat.messages);
  const body = {model: $("model").value, messages: messages, stream: true, stream_options: {include_usage: true},
                temperature: Number($("temperature").value), top_p: Number($("top-p").value)};
  const maxTokens = $("max-tokens").value.trim();
  if (maxTokens) body.max_tokens = Number(maxTokens);
  const stop = $("stop").value.split("\n").filter((line) => line !== "");
  if (stop.length) body.stop = stop;
  const seed = $("seed").value.trim();
  if (seed) body.seed = Number(seed);
  return body;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop-button").disabled = !busy;
  $("regenerate").disabled = busy || chat.messages.length === 0;
}

// Calls `onEvent` with each parsed `data:` event of a server-sent event stream.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      if (data && data !== "[DONE]") onEvent(JSON.parse(data));
    }
  }
}

// Time to first token, and tokens/s over the decode (first to last token).
function statsText(reply) {
  const parts = [];
  const tokens = reply.usageTokens ?? reply.chunks;
  parts.push(tokens + " tokens");
  if (reply.firstAt !== null) {
    reply.ttftMs = reply.firstAt - reply.startAt;
    parts.push("TTFT " + Math.round(reply.ttftMs) + " ms");
    const seconds = (reply.lastAt - reply.firstAt) / 1000;
    if (tokens > 1 && seconds > 0) {
      reply.tokensPerS = (tokens - 1) / seconds;
      parts.push(reply.tokensPerS.toFixed(1) + " tokens/s");
    }
  }
  return parts.join(" · ");
}

async function generate() {
  const bubble = addBubble("assistant", "");
  bubble.dataset.state = "streaming";
  const content = bubble.querySelector(".content");
  const stats = document.createElement("div");
  stats.className = "stats";
  bubble.append(stats);
  const reply = {text: "", chunks: 0, usageTokens: null, startAt: performance.now(), firstAt: null, lastAt: null,
                 finishReason: null};
  chat.controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("/v1/chat/completions", {method: "POST", headers: apiHeaders(),
      body: JSON.stringify(requestBody()), signal: chat.controller.signal});
    if (!response.ok) {
      const text = await errorText(response);
      if (response.status === 401) askForKey("The server refused the key. " + text);
      throw new Error(text);
    }
    await readEvents(response, (event) => {
      if (event.error) throw new Error(event.error.message || JSON.stringify(event.error));
      if (event.usage) reply.usageTokens = event.usage.completion_tokens;
      const choice = (event.choices || [])[0];
      if (!choice) return;
      if (choice.finish_reason) reply.finishReason = choice.finish_reason;
      const piece = choice.delta && choice.delta.content;
      if (!piece) return;
      const now = performance.now();
      if (reply.firstAt === null) reply.firstAt = now;
      reply.lastAt = now;
      reply.chunks += 1;
      reply.text += piece;
      content.innerHTML = renderMarkdown(reply.text);
      stats.textContent = statsText(reply);
      bubble.scrollIntoView({block: "end"});
    });
    bubble.dataset.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      bubble.dataset.state = "stopped";
    } else {
      bubble.dataset.state = "error";
      bubble.classList.add("error");
      content.textContent = (reply.text ? reply.text + "\n\n" : "") + e.message;
    }
  } finally {
    chat.controller = null;
    if (reply.text) chat.messages.push({role: "assistant", content: reply.text});
    const suffix = bubble.dataset.state === "stopped" ? " · stopped" :
      reply.finishReason === "length" ? " · cut at max tokens" : "";
    if (bubble.dataset.state !== "error" || reply.text) stats.textContent = statsText(reply) + suffix;
    if (reply.ttftMs !== undefined) bubble.dataset.ttftMs = reply.ttftMs.toFixed(1);
    if (reply.tokensPerS !== undefined) bubble.dataset.tokensPerS = reply.tokensPerS.toFixed(2);
    bubble.dataset.replyTokens = String(reply.usageTokens ?? reply.chunks);
    setBusy(false);
  }
}

function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chat.controller) return;
  if (!$("model").value) {
    showNotice("No model to ask: " + ($("key-form").hidden ? "the model list did not load." : "enter the API key."));
    return;
  }
  chat.messages.push({role: "user", content: text});
  addBubble("user", text);
  $("prompt").value = "";
  generate();
}

function regenerate() {
  if (chat.controller) return;
  const bubbles = $("messages").querySelectorAll(".message");
  const last = bubbles[bubbles.length - 1];
  if (last && last.classList.contains("assistant")) {
    if (chat.messages.length && chat.messages[chat.messages.length - 1].role === "assistant") chat.messages.pop();
    last.remove();
  }
  if (chat.messages.length && chat.messages[chat.messages.length - 1].role === "user") generate();
}

function bindRange(id) {
  const update = () => { $(id + "-value").textContent = $(id).value; };
  $(id).addEventListener("input", update);
  update();
}

document.addEventListener("DOMContentLoaded", () => {
  bindRange("temperature");
  bindRange("top-p");
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) send(event);
  });
  $("stop-button").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
    chat.messages = [];
    $("messages").replaceChildren();
    setBusy(false);
  });
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    $("api-key").value = "";
    loadModels();
  });
  $("key-button").addEventListener("click", () => askForKey("The key is kept in this tab only."));
  loadModels();
  startLiveMetrics();
});
