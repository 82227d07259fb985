// The page: ask (streamed answer, sub-questions, cited pages with their figure outlined, the cache at work),
// documents (upload with each file's ingest job, list, delete), the key. Plain DOM, no framework.

import { ApiError, events, getJSON, imageURL, request, storeKey, storedKey, upload } from "./api.js";

const $ = (id) => document.getElementById(id);
const POLL_MS = 500;
const STAGES = [  // Timings' fields, in the order they run
  ["decompose_s", "decompose"], ["retrieve_s", "retrieve"], ["answer_s", "answer"],
  ["sub_answers_s", "sub-answers"], ["synthesis_s", "synthesis"],
];

const state = { conversationId: null, image: null, asking: null, documentsOffset: 0 };

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-") || k.startsWith("aria-") || k === "role" || k === "for") node.setAttribute(k, v);
    else node[k] = v;
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

const fmt = (n) => Number(n).toLocaleString("en");
const secs = (s) => `${Number(s).toFixed(s < 0.1 ? 3 : 2)} s`;

// --- errors: the API's own words, in the alert region ---------------------------------------------------

function showError(err) {
  const box = $("alert");
  box.replaceChildren();
  if (err instanceof ApiError) {
    box.append(el("p", {}, el("strong", { text: `${err.status ? `${err.status} ` : ""}${err.type}: ` }), err.message));
    if (err.fix) box.append(el("p", { class: "fix" }, el("strong", { text: "Fix: " }), err.fix));
  } else {
    box.append(el("p", { text: `${err.name}: ${err.message}` }));
  }
  box.dataset.status = err.status ?? "";
}

function clearError() {
  $("alert").replaceChildren();
  delete $("alert").dataset.status;
}

// --- the key ---------------------------------------------------------------------------------------------

function useKey(event) {
  event.preventDefault();
  storeKey($("key").value.trim());
  clearError();
  refreshDocuments();
}

function forgetKey() {
  storeKey("");
  $("key").value = "";
  $("key").focus();
}

// --- ask --------------------------------------------------------------------------------------------------

function chooseImage(file) {
  if (!file) return;
  if (!file.type.startsWith("image/")) {
    showError(new ApiError(0, { type: "not_an_image", message: `${file.name} is not an image`,
                                fix: "drop a PNG, JPEG, WebP or TIFF file" }));
    return;
  }
  state.image = file;
  const preview = $("image-preview");
  if (preview.src) URL.revokeObjectURL(preview.src);
  preview.src = URL.createObjectURL(file);
  $("image-name").textContent = `${file.name} (${fmt(file.size)} bytes)`;
  $("image-chosen").hidden = false;
}

function clearImage() {
  state.image = null;
  $("image").value = "";
  $("image-chosen").hidden = true;
  const preview = $("image-preview");
  if (preview.src) URL.revokeObjectURL(preview.src);
  preview.removeAttribute("src");
}

function showConversation() {
  $("conversation").textContent = state.conversationId
    ? `Conversation ${state.conversationId}: a follow-up reuses its image, not sent again.`
    : "New conversation.";
}

function newConversation() {
  state.conversationId = null;
  clearImage();
  showConversation();
  $("question").focus();
}

function askRequest(question) {
  const tier = $("tier").value.trim();
  const doc = $("scope").value;
  const conversation = state.conversationId;
  if (state.image) {  // multipart: the image goes as a file, not as base64 in JSON
    const form = new FormData();
    form.append("question", question);
    form.append("stream", "true");
    form.append("images", state.image, state.image.name);
    if (tier) form.append("tier", tier);
    if (doc) form.append("docs", doc);
    if (conversation) form.append("conversation_id", conversation);
    return ["v1/ask/upload", { method: "POST", body: form }];
  }
  const json = { question, stream: true };
  if (tier) json.tier = tier;
  if (doc) json.docs = [doc];
  if (conversation) json.conversation_id = conversation;
  return ["v1/ask", { method: "POST", json }];
}

async function ask(event) {
  event.preventDefault();
  if (state.asking) return;
  const question = $("question").value.trim();
  if (!question) return;
  clearError();
  const withImage = state.image ? state.image.name : null;
  const turn = new Turn(question, {
    image: withImage, followUp: !withImage && state.conversationId, tier: $("tier").value.trim(),
    scope: $("scope").value ? $("scope").selectedOptions[0].textContent : null,
  });
  const [path, init] = askRequest(question);
  const controller = new AbortController();
  state.asking = controller;
  setAsking(true);
  try {
    const response = await request(path, { ...init, signal: controller.signal });
    let done = false;
    for await (const { name, data } of events(response)) {
      if (name === "error") throw new ApiError(0, data.error);  // after the status line: no status of its own
      done = turn.on(name, data) || done;
    }
    if (!done) throw new ApiError(0, { type: "stream_ended", message: "the answer stream ended before its end",
                                       fix: "ask again; the server log says why" });
    const answer = turn.answer;
    if (answer.conversation_id) {
      state.conversationId = answer.conversation_id;
      clearImage();  // kept by the conversation now: follow-ups name it instead of sending it again
    }
    showConversation();
    $("question").value = "";
  } catch (err) {
    if (err.name === "AbortError") turn.fail("stopped");
    else {
      turn.fail("failed");
      showError(err);
      if (["unknown_conversation", "image_expired"].includes(err.type)) {  // gone on the server: start anew
        state.conversationId = null;
        showConversation();
      }
    }
  } finally {
    state.asking = null;
    setAsking(false);
  }
}

function setAsking(on) {
  $("ask-button").disabled = on;
  $("stop").disabled = !on;
  $("ask-form").setAttribute("aria-busy", on ? "true" : "false");
}

/** One question and its answer as it streams in: sub-questions, cited pages, tokens, then the cache. */
class Turn {
  constructor(question, { image, followUp, tier, scope }) {
    this.answer = null;
    this.text = document.createTextNode("");  // one text node, appended to: each token is one change
    const meta = [image && `with image ${image}`, followUp && "follow-up: reuses the conversation's image",
                  tier && `tier ${tier}`, scope && `in ${scope}`].filter(Boolean).join(" · ");
    this.subQuestions = el("ol", { class: "sub-questions" });
    this.subSource = el("p", { class: "note" });
    this.subBox = el("div", { class: "sub-box" }, el("h4", { text: "Sub-questions" }), this.subQuestions,
                     this.subSource);
    this.subBox.hidden = true;
    this.subAnswers = el("ul", { class: "sub-answers" });
    this.answerText = el("p", { class: "answer", "aria-live": "polite", "aria-busy": "true" }, this.text);
    this.modelNote = el("p", { class: "note model-note" });
    this.cache = el("div", { class: "cache" });
    this.cache.hidden = true;
    this.sources = el("ul", { class: "source-list" });
    this.sourceBox = el("div", { class: "sources" }, el("h4", { text: "Sources" }), this.sources);
    this.sourceBox.hidden = true;
    this.node = el("li", { class: "turn", "data-state": "streaming" },
      el("div", { class: "turn-main" },
        el("h3", { class: "question", text: question }),
        meta ? el("p", { class: "note", text: meta }) : null,
        this.subBox,
        el("div", { class: "answer-box" }, el("h4", { text: "Answer" }), this.answerText, this.subAnswers,
           this.modelNote),
        this.cache),
      this.sourceBox);
    $("turns").append(this.node);
    this.node.scrollIntoView({ block: "nearest" });
  }

  /** Handles one event; true once the answer is complete. */
  on(name, data) {
    if (name === "sub_questions") {
      this.subQuestions.replaceChildren(...data.sub_questions.map((q) => el("li", { text: q })));
      this.subSource.textContent = `split by: ${data.sub_question_source}`;
      this.subBox.hidden = false;
    } else if (name === "citations") {
      this.showSources(data.citations);
    } else if (name === "sub_answer") {
      this.subAnswers.append(el("li", {}, el("strong", { text: `${data.sub_question} ` }), data.answer));
    } else if (name === "token") {
      if (data.text) this.text.appendData(data.text);
    } else if (name === "done") {
      this.finish(data.answer);
      return true;
    }
    return false;
  }

  showSources(citations) {
    this.sourcesShown = true;
    this.sources.replaceChildren(...citations.map((c) => this.source(c)));
    this.sourceBox.hidden = citations.length === 0;
  }

  source(c) {
    const fig = c.figure;
    let path = `v1/pages/${encodeURIComponent(c.page_id)}/image`;
    if (fig && fig.number !== null) path += `?figure=${fig.number}${fig.kind === "table" ? "&kind=table" : ""}`;
    else if (fig) path += `?bbox=${fig.bbox.join(",")}`;
    const where = `${c.doc}, page ${c.page}`;
    const img = el("img", { alt: fig ? `${where}, ${figureName(fig)} outlined in red` : `${where}`,
                            "data-src": path, loading: "eager" });
    const status = el("p", { class: "note", text: "loading the page image..." });
    const item = el("li", { class: "source", "data-page-id": c.page_id },
      el("figure", {}, img,
        el("figcaption", {},
          el("span", { class: "where", text: where }),
          el("span", { class: "score", text: `score ${c.score.toFixed(4)}` }),
          fig ? el("span", { class: "figure-caption", text: figureName(fig) }) : el("span", { class: "note",
            text: "the page as a whole" }))),
      status);
    imageURL(path).then((src) => {
      img.src = src;
      status.remove();
    }, (err) => {
      status.textContent = `page image unavailable: ${err.message}${err.fix ? ` (${err.fix})` : ""}`;
    });
    return item;
  }

  finish(answer) {
    this.answer = answer;
    if (this.text.data !== answer.answer) this.text.data = answer.answer;  // the tokens add up to it
    this.answerText.setAttribute("aria-busy", "false");
    if (!this.sourcesShown) this.showSources(answer.citations);  // the `citations` event showed the same pages
    const model = answer.model;
    this.modelNote.textContent = model.random_weights ? `${model.name}: ${model.note}` : `model: ${model.name}`;
    this.cache.replaceChildren(...cachePanel(answer));
    this.cache.hidden = false;
    this.node.dataset.state = "done";
  }

  fail(how) {
    this.answerText.setAttribute("aria-busy", "false");
    this.node.dataset.state = how;
    if (!this.text.data) this.text.data = how === "stopped" ? "(stopped)" : "(no answer: see the error above)";
  }
}

function figureName(fig) {
  if (fig.caption) return fig.caption;
  const kind = fig.kind[0].toUpperCase() + fig.kind.slice(1);
  return fig.number !== null ? `${kind} ${fig.number}` : `${kind} (uncaptioned)`;
}

/** The cache at work for one answer: image tokens from the prefix cache (a bar), vision forwards, the
 * question's image, and the stage timings (a stacked bar). Every figure is also in text. */
function cachePanel(answer) {
  const u = answer.usage;
  const share = u.image_tokens ? u.cached_image_tokens / u.image_tokens : 0;
  const out = [el("h4", { text: "Cache" })];
  const fill = el("span", { class: "fill" });
  fill.style.width = `${(100 * share).toFixed(1)}%`;
  const cached = `from cache: ${fmt(u.cached_image_tokens)} of ${fmt(u.image_tokens)} image tokens`;
  out.push(el("p", { class: "cache-line" }, "Image tokens ", el("strong", { class: "cached-image-tokens", text: cached }),
              ` (${Math.round(100 * share)}%)`),
           el("div", { class: "bar", "aria-hidden": "true" }, fill));
  const images = answer.question_images || [];
  const forwards = el("p", { class: "forwards" }, "Vision forwards: ",
                      el("strong", { class: "vision-forwards", text: String(u.vision_encodes) }));
  if (images.length && u.vision_encodes === 0) {
    forwards.append(" ", el("span", { class: "badge image-from-cache", text: "image from cache" }));
  }
  out.push(forwards);
  if (images.length) {
    const tokens = images.reduce((n, i) => n + i.image_tokens, 0);
    const how = u.vision_encodes === 0
      ? "from the cache: not sent or encoded again"
      : `encoded now (${u.vision_encodes} vision forward${u.vision_encodes === 1 ? "" : "s"}), kept for follow-ups`;
    out.push(el("p", { class: "question-image note",
                       text: `Question image${images.length > 1 ? "s" : ""}: ${fmt(tokens)} tokens, ${how}.` }));
  }
  out.push(el("p", { class: "note" },
    `Prompt tokens ${fmt(u.prompt_tokens)} (${fmt(u.cached_tokens)} from cache), completion tokens `,
    `${fmt(u.completion_tokens)}, first token after ${secs(u.ttft_s)}.`));
  if (answer.timings) out.push(...timingsBar(answer.timings));
  if (answer.pages_left_out?.length) {
    out.push(el("p", { class: "note", text: `Left out (no room in the prompt): ${answer.pages_left_out.join(", ")}` }));
  }
  return out;
}

function timingsBar(timings) {
  const stages = STAGES.filter(([k]) => typeof timings[k] === "number").map(([k, name]) => [name, timings[k], k]);
  const total = stages.reduce((n, [, s]) => n + s, 0);
  const stack = el("div", { class: "stack", "aria-hidden": "true" });
  const legend = el("ul", { class: "legend", "aria-label": "Stage timings" });
  for (const [name, s, key] of stages) {
    const seg = el("span", { class: `seg seg-${key}`, title: `${name} ${secs(s)}` });
    seg.style.width = `${total ? (100 * s) / total : 0}%`;
    stack.append(seg);
    legend.append(el("li", {}, el("span", { class: `swatch seg-${key}`, "aria-hidden": "true" }),
                     `${name} ${secs(s)}`));
  }
  return [el("p", { class: "timings-head", text: `Stage timings: ${secs(total)} in all` }), stack, legend];
}

// --- documents --------------------------------------------------------------------------------------------

async function refreshDocuments({ more = false } = {}) {
  const offset = more ? state.documentsOffset : 0;
  let page;
  try {
    page = await getJSON(`v1/documents?limit=100&offset=${offset}`);
  } catch (err) {
    showError(err);
    // A server with keys (or tenants) lists nothing to a tab without the right one: say so, not "empty".
    $("documents-status").textContent = err.status === 401
      ? "Enter your API key (or your tenant's key) above to see your documents."
      : "The document list could not be read.";
    return;
  }
  const rows = page.documents.map(documentRow);
  if (more) $("document-rows").append(...rows);
  else $("document-rows").replaceChildren(...rows);
  state.documentsOffset = page.next_offset ?? 0;
  $("documents-more").hidden = page.next_offset === null;
  $("documents-status").textContent = `${fmt(page.total)} document${page.total === 1 ? "" : "s"} in the index.`;
  fillScope();
}

function documentRow(d) {
  const remove = el("button", { type: "button", class: "danger small", text: "Delete",
                                "aria-label": `Delete ${d.doc}` });
  remove.addEventListener("click", () => confirmDelete(d, remove));
  return el("tr", { "data-doc-id": d.doc_id, "data-doc": d.doc },
    el("td", {}, el("span", { class: "doc-name", text: d.doc }),
       d.path !== d.doc ? el("span", { class: "note", text: ` ${d.path}` }) : null),
    el("td", { text: d.indexed_pages === d.num_pages ? `${d.num_pages}` : `${d.indexed_pages} of ${d.num_pages}` }),
    el("td", {}, remove));
}

function fillScope() {
  const scope = $("scope");
  const chosen = scope.value;
  const docs = [...$("document-rows").querySelectorAll("tr")].map((r) => [r.dataset.docId, r.dataset.doc]);
  scope.replaceChildren(el("option", { value: "", text: "All documents" }),
                        ...docs.map(([id, name]) => el("option", { value: id, text: name })));
  scope.value = docs.some(([id]) => id === chosen) ? chosen : "";
}

function confirmDelete(doc, opener) {
  const dialog = $("confirm-delete");
  $("confirm-text").textContent = `${doc.doc} and its ${doc.indexed_pages} indexed page`
    + `${doc.indexed_pages === 1 ? "" : "s"} leave the index. Answers can no longer cite it.`;
  dialog.dataset.docId = doc.doc_id;
  const close = (yes) => {
    dialog.close(yes ? "delete" : "cancel");
    $("confirm-yes").onclick = $("confirm-cancel").onclick = null;
    opener.focus();
    if (yes) deleteDocument(doc);
  };
  $("confirm-yes").onclick = () => close(true);
  $("confirm-cancel").onclick = () => close(false);
  dialog.oncancel = () => close(false);  // Escape
  dialog.showModal();
  $("confirm-cancel").focus();
}

async function deleteDocument(doc) {
  try {
    const gone = await getJSON(`v1/documents/${encodeURIComponent(doc.doc_id)}`, { method: "DELETE" });
    await refreshDocuments();
    $("documents-status").textContent = `Deleted ${gone.doc}: ${gone.pages} page${gone.pages === 1 ? "" : "s"} `
      + "left the index.";
  } catch (err) {
    showError(err);
  }
}

function uploadFiles(files) {
  for (const file of files) uploadFile(file);
  $("files").value = "";
}

/** One file: its bytes sent (the bar fills), then its ingest job polled until it ends (files and pages done). */
async function uploadFile(file) {
  const bar = el("progress", { max: 100, value: 0, "aria-label": `Progress of ${file.name}` });
  const status = el("span", { class: "upload-status", text: "uploading" });
  const row = el("li", { class: "upload", "data-file": file.name, "data-state": "uploading" },
                 el("span", { class: "upload-name", text: file.name }), bar, status);
  $("uploads").prepend(row);
  const form = new FormData();
  form.append("file", file, file.name);
  let job;
  try {
    const sent = await upload("v1/documents", form, (done, total) => {
      bar.value = Math.round((100 * done) / total);
      say(status, `uploading: ${bar.value}%`);
    });
    job = sent.job;
    row.dataset.docId = sent.doc_id;
    row.dataset.jobId = job.id;
    bar.removeAttribute("value");  // indeterminate until the job says how far it got
    while (["queued", "running", "cancelling"].includes(job.status)) {
      row.dataset.state = job.status;
      say(status, jobText(job));
      await new Promise((r) => setTimeout(r, POLL_MS));
      job = await getJSON(`v1/ingest/${encodeURIComponent(job.id)}`);
    }
  } catch (err) {
    row.dataset.state = "failed";
    say(status, `failed: ${err.message}`);
    showError(err);
    return;
  }
  const failed = job.report?.failed?.[0];
  row.dataset.state = job.status === "done" && !failed ? "done" : "failed";
  bar.max = 1;
  bar.value = row.dataset.state === "done" ? 1 : 0;
  say(status, failed ? `failed: ${failed.error}` : jobText(job));
  await refreshDocuments();
}

/** Text that changed only: the uploads list is a live region, and a poll that learnt nothing says nothing. */
function say(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

function jobText(job) {
  if (job.status === "queued") return "queued for ingest";
  if (job.status === "done") {
    const r = job.report;
    return `done: ${r.pages} page${r.pages === 1 ? "" : "s"} indexed (${r.encoded} encoded, ${r.cached} cached, `
      + `${r.figures} figure${r.figures === 1 ? "" : "s"})`;
  }
  if (job.status === "failed" || job.status === "cancelled") return `${job.status}: ${job.error || ""}`;
  const p = job.progress;
  return p ? `ingesting: file ${Math.min(p.files_done + 1, p.files_total)} of ${p.files_total}, `
    + `${p.pages_done} page${p.pages_done === 1 ? "" : "s"} indexed` : "ingesting";
}

// --- drag and drop ----------------------------------------------------------------------------------------

function dropZone(zone, onFiles) {
  zone.addEventListener("dragover", (e) => {
    e.preventDefault();
    zone.classList.add("over");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    if (e.dataTransfer?.files?.length) onFiles([...e.dataTransfer.files]);
  });
}

// --- start ------------------------------------------------------------------------------------------------

function start() {
  $("key").value = storedKey();
  $("key-form").addEventListener("submit", useKey);
  $("key-forget").addEventListener("click", forgetKey);
  $("ask-form").addEventListener("submit", ask);
  $("question").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("ask-form").requestSubmit();
  });
  $("stop").addEventListener("click", () => state.asking?.abort());
  $("new-conversation").addEventListener("click", newConversation);
  $("image").addEventListener("change", (e) => chooseImage(e.target.files[0]));
  $("image-clear").addEventListener("click", clearImage);
  dropZone($("image-drop"), (files) => chooseImage(files[0]));
  $("files").addEventListener("change", (e) => uploadFiles([...e.target.files]));
  dropZone($("files-drop"), uploadFiles);
  $("documents-refresh").addEventListener("click", () => refreshDocuments());
  $("documents-more").addEventListener("click", () => refreshDocuments({ more: true }));
  showConversation();
  refreshDocuments();
  document.body.dataset.ready = "true";
}

start();
