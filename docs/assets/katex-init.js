// Typeset the formulas pymdownx.arithmatex leaves as \( … \) and \[ … \] (KaTeX, vendored in
// assets/katex under its MIT licence: pages render with no network). Material's instant
// navigation swaps pages without a reload, so typeset on each page it shows.
function gradlabTypeset(root) {
  renderMathInElement(root, {
    delimiters: [
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
  });
}
if (typeof document$ !== "undefined") {
  document$.subscribe(({ body }) => gradlabTypeset(body));
} else {
  document.addEventListener("DOMContentLoaded", () => gradlabTypeset(document.body));
}
