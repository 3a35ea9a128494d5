// gpucoord console: follow the fleet over Server-Sent Events. The server renders every page; this only
// swaps in the <main> it pushes (event "view") and adds each event it pushes (event "fleet") to the list.
(function () {
  "use strict";
  var body = document.body;
  var live = document.getElementById("live");
  var after = body.getAttribute("data-seq") || "0";
  var url = "/api/events?view=" + encodeURIComponent(body.getAttribute("data-view") || "/") + "&after=" + after;
  var pushes = 0;
  var source = new EventSource(url);
  function state(text, cls) {
    live.textContent = text;
    live.className = cls;
  }
  source.onopen = function () { state("live", "ok"); };
  source.onerror = function () { state("reconnecting", "warn"); };
  source.addEventListener("view", function (msg) {
    var data = JSON.parse(msg.data);
    document.getElementById("main").innerHTML = data.html;
    pushes += 1;
    body.setAttribute("data-pushes", String(pushes));
    body.setAttribute("data-live", "1");
    state("live", "ok");
  });
  source.addEventListener("fleet", function (msg) {
    var data = JSON.parse(msg.data);
    var list = document.getElementById("recent");
    var none = list.querySelector("li.none");
    if (none) { list.removeChild(none); }
    list.insertAdjacentHTML("afterbegin", data.html);
    while (list.children.length > 30) { list.removeChild(list.lastElementChild); }
    body.setAttribute("data-seq", String(data.seq));
  });
})();
