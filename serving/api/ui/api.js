// The REST API as the page uses it: the key (this tab's session only), requests that carry it, the API's error
// body read into an ApiError, server-sent events read from a fetch() body, uploads with their byte progress.

const KEY = "mmrag.key";
// The API's root, found from this file (/ui/api.js), so that a proxy's prefix carries over to every request.
const ROOT = new URL("../", import.meta.url);

export function storedKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function storeKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

/** An error as the API says it: `{"error": {"type", "message", "fix", "param"?}}` and the status. */
export class ApiError extends Error {
  constructor(status, { type, message, fix, param }) {
    super(message);
    this.status = status;
    this.type = type;
    this.fix = fix || "";
    this.param = param;
  }
}

function authorised(headers = {}) {
  const out = new Headers(headers);
  const key = storedKey();
  if (key) out.set("Authorization", `Bearer ${key}`);
  return out;
}

export function url(path) {
  return new URL(path, ROOT);
}

async function errorOf(response) {
  let detail = null;
  try {
    detail = (await response.json()).error;
  } catch {
    // not the API's error shape (a proxy's page, say): said by its status below
  }
  return new ApiError(response.status, detail || {
    type: "http_error", message: `${response.status} ${response.statusText || "error"} from ${response.url}`,
    fix: "check that this page is served by mmrag and that it is running",
  });
}

/** fetch() with the key; a response that is not 2xx throws its ApiError. ``json``: a body sent as JSON. */
export async function request(path, { method = "GET", json, body, signal } = {}) {
  const init = { method, headers: authorised(), signal, body };
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers.set("Content-Type", "application/json");
  }
  const response = await fetch(url(path), init);
  if (!response.ok) throw await errorOf(response);
  return response;
}

export async function getJSON(path, options) {
  return (await request(path, options)).json();
}

/** The events of a `text/event-stream` body, each `{name, data}` (data parsed from its JSON), as they arrive. */
export async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = parseEvent(block);
      if (event) yield event;
    }
  }
}

function parseEvent(block) {
  let name = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) name = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
  }
  return data.length ? { name, data: JSON.parse(data.join("\n")) } : null;
}

/** A page image (the route needs the key, so not a plain <img src>) as an object URL. */
export async function imageURL(path, signal) {
  const response = await request(path, { signal });
  return URL.createObjectURL(await response.blob());
}

/** POST a multipart form with XMLHttpRequest, the one browser API that reports upload progress:
 * ``onProgress(sent, total)``; resolves to the JSON body, rejects with its ApiError. */
export function upload(path, form, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", url(path));
    const key = storedKey();
    if (key) xhr.setRequestHeader("Authorization", `Bearer ${key}`);
    xhr.responseType = "json";
    xhr.upload.onprogress = (e) => e.lengthComputable && onProgress(e.loaded, e.total);
    xhr.onload = () => {
      if (xhr.status >= 200 && xhr.status < 300) resolve(xhr.response);
      else reject(new ApiError(xhr.status, (xhr.response && xhr.response.error) || {
        type: "http_error", message: `${xhr.status} from ${path}`, fix: "see the server log" }));
    };
    xhr.onerror = () => reject(new ApiError(0, { type: "network", message: "the upload did not reach the server",
                                                 fix: "check that mmrag is running, then upload again" }));
    xhr.send(form);
  });
}
