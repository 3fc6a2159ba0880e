"""A self-contained, offline HTML attention view: no CDN, all JS and CSS inline.

One :class:`AttentionView` is a heatmap of one layer and head (or the average of
the heads, when there are several) with layer and head pickers; rows are queries and
columns keys (both axes labelled); one colour scale per layer, shared by its heads and
their average; a weight of exactly 0 (a masked cell) is hatched grey, not coloured as a
small weight. Hovering a cell shows the query token, the key token and the exact weight.
Several views work on one page (or in one notebook): each has its own element id and its
script only touches its own element. The page is rendered by a jinja2 template; tokens and
weights go in as JSON (``tojson``), so no token can break the page.

Test hook: the page's URL hash ``#layer=1&head=2&hover=3,4`` selects the layer,
the head (``head=avg`` for the average) and hovers query 3 / key 4 on load, through
the same event handlers a person triggers.
"""

from __future__ import annotations

import functools
import itertools
import secrets
from typing import Any

from attnkit.viz._page import HtmlPage
from attnkit.viz.maps import AttentionMaps

__all__ = ["AttentionView"]

_COUNTER = itertools.count()

_CSS = """
#ID{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;font-size:13px;color:#222;
 display:inline-block;padding:8px;background:#fff}
#ID .akv-title{font-weight:600;font-size:15px;margin:4px 0 8px}
#ID .akv-controls label{margin-right:14px}
#ID table{border-collapse:collapse;margin-top:8px}
#ID td.akv-c{width:28px;height:28px;border:1px solid #fff;cursor:crosshair}
#ID td.akv-c.akv-on{outline:2px solid #e4572e;outline-offset:-2px}
#ID td.akv-c.akv-m{background:repeating-linear-gradient(45deg,#eee 0 3px,#ccc 3px 5px)}
#ID th.akv-axis{font-style:italic;color:#666;font-size:11px}
#ID th{font-weight:400;padding:2px 4px;white-space:nowrap}
#ID th.akv-k{writing-mode:vertical-rl;transform:rotate(180deg);text-align:left;height:auto}
#ID th.akv-q{text-align:right}
#ID th.akv-hl{color:#e4572e;font-weight:700}
#ID .akv-hover{margin-top:8px;min-height:1.4em;font-family:ui-monospace,monospace}
#ID .akv-bar{display:flex;align-items:center;gap:6px;margin-top:6px}
#ID .akv-grad{width:160px;height:10px;background:linear-gradient(to right,GRAD)}
"""

# viridis at 5 stops: the same colour map as the PNG/SVG pictures
_STOPS = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]

_JS = r"""
(function(){
const root=document.getElementById({{ eid|tojson }}), data={{ data|tojson }}, stops={{ stops|tojson }};
const selL=root.querySelector(".akv-layer"), selH=root.querySelector(".akv-head");
const grid=root.querySelector("table"), hover=root.querySelector(".akv-hover");
const title=root.querySelector(".akv-title"), vmaxEl=root.querySelector(".akv-vmax");
function colour(x){x=Math.max(0,Math.min(1,x))*(stops.length-1);const i=Math.min(Math.floor(x),stops.length-2),f=x-i;
 const c=stops[i].map((v,j)=>Math.round(v+(stops[i+1][j]-v)*f));return "rgb("+c.join(",")+")";}
data.layers.forEach((l,i)=>{const o=document.createElement("option");o.value=i;o.textContent=l.name;selL.appendChild(o);});
function matrix(){const l=data.layers[+selL.value];if(selH.value!=="avg")return l.weights[+selH.value];
 const h=l.weights.length;return l.weights[0].map((row,q)=>row.map((_,k)=>l.weights.reduce((s,w)=>s+w[q][k],0)/h));}
function heads(){const l=data.layers[+selL.value],keep=selH.value,many=l.weights.length>1;selH.innerHTML="";
 if(many){const a=document.createElement("option");a.value="avg";a.textContent="average of heads";selH.appendChild(a);}
 l.weights.forEach((_,i)=>{const o=document.createElement("option");o.value=i;o.textContent="head "+i;selH.appendChild(o);});
 selH.value=(keep!==""&&((keep==="avg"&&many)||(keep!=="avg"&&+keep<l.weights.length)))?keep:(many?"avg":"0");}
function layerMax(l){let v=0;l.weights.forEach(h=>h.forEach(r=>r.forEach(x=>{v=Math.max(v,x);})));return v||1;}
function draw(){const l=data.layers[+selL.value],m=matrix(),q0=data.tokens.length-m.length,vmax=layerMax(l);
 vmaxEl.textContent=vmax.toFixed(4);
 title.textContent=l.label+" \u00b7 "+(selH.value==="avg"?"average of "+l.weights.length+" heads":"head "+selH.value);
 grid.innerHTML="";const head=grid.insertRow(),corner=document.createElement("th");corner.className="akv-axis";
 corner.textContent="query \u2193 \u00b7 key \u2192";head.appendChild(corner);
 data.tokens.forEach(t=>{const th=document.createElement("th");th.className="akv-k";th.textContent=t;head.appendChild(th);});
 m.forEach((row,q)=>{const tr=grid.insertRow(),th=document.createElement("th");th.className="akv-q";
  th.textContent=data.tokens[q0+q];tr.appendChild(th);
  row.forEach((v,k)=>{const td=tr.insertCell();td.className="akv-c";td.dataset.q=q;td.dataset.k=k;
   const tip=data.tokens[q0+q]+" \u2192 "+data.tokens[k]+": ";
   if(v===0){td.classList.add("akv-m");td.title=tip+"0 (masked)";}
   else{td.style.background=colour(v/vmax);td.title=tip+v.toFixed(6);}});});
 hover.textContent="hover a cell: query \u2192 key: weight (hatched: weight 0, masked)";}
function show(td){root.querySelectorAll(".akv-on,.akv-hl").forEach(e=>e.classList.remove("akv-on","akv-hl"));
 const q=+td.dataset.q,k=+td.dataset.k,m=matrix(),q0=data.tokens.length-m.length;td.classList.add("akv-on");
 grid.rows[0].cells[k+1].classList.add("akv-hl");grid.rows[q+1].cells[0].classList.add("akv-hl");
 hover.textContent="query \u201c"+data.tokens[q0+q]+"\u201d \u2192 key \u201c"+data.tokens[k]+"\u201d: weight "+m[q][k].toFixed(6)+(m[q][k]===0?" (masked)":"");}
grid.addEventListener("mouseover",e=>{const td=e.target.closest("td.akv-c");if(td)show(td);});
selL.addEventListener("change",()=>{heads();draw();});
selH.addEventListener("change",draw);
heads();draw();
const p=new URLSearchParams((location.hash||"").slice(1));
if(p.has("layer")){selL.value=p.get("layer");selL.dispatchEvent(new Event("change"));}
if(p.has("head")){selH.value=p.get("head");selH.dispatchEvent(new Event("change"));}
if(p.has("hover")){const [q,k]=p.get("hover").split(",").map(Number);
 const td=grid.querySelector('td[data-q="'+q+'"][data-k="'+k+'"]');
 if(td)td.dispatchEvent(new MouseEvent("mouseover",{bubbles:true}));}
})();
"""


_FRAGMENT = (
    '<div id="{{ eid }}" class="akv"><style>{{ css|safe }}</style>'
    "<div><strong>{{ title }}</strong></div>"
    '<div class="akv-controls"><label>{{ kind }} <select class="akv-layer"></select></label>'
    '<label>head <select class="akv-head"></select></label></div>'
    '<div class="akv-title"></div><table></table>'
    '<div class="akv-bar"><span>0</span><span class="akv-grad"></span>'
    '<span class="akv-vmax"></span> (one scale per layer)</div>'
    '<div class="akv-hover"></div><script>' + _JS + "</script></div>"
)


@functools.cache
def _template() -> Any:
    import jinja2

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(_FRAGMENT)


class AttentionView(HtmlPage):
    """An interactive heatmap of attention maps as one offline HTML file.

    Args:
        maps: the attention maps (see :mod:`attnkit.viz.maps`).
        title: a heading over the view.
        decimals: digits kept per weight in the embedded data (hover shows 6).

    Example:
        >>> view = AttentionView(maps)          # doctest: +SKIP
        >>> view                                # a notebook cell shows it  # doctest: +SKIP
        >>> view.save("attention.html")         # doctest: +SKIP
    """

    MARGIN = 12

    def __init__(self, maps: AttentionMaps, *, title: str = "attention", decimals: int = 6) -> None:
        self.maps = maps
        self.title = title
        self.decimals = decimals
        self.element_id = f"akv-{next(_COUNTER)}-{secrets.token_hex(4)}"

    def _data(self) -> dict:
        layers = []
        for i, (name, w) in enumerate(zip(self.maps.names, self.maps.weights, strict=True)):
            weights = [
                [[round(v, self.decimals) for v in row] for row in head] for head in w.tolist()
            ]
            layers.append({"name": name, "label": self.maps.label(i), "weights": weights})
        return {"tokens": self.maps.tokens, "layers": layers}

    def fragment(self) -> str:
        """The view as an HTML fragment (``<div>`` with inline ``<style>`` and ``<script>``)."""
        grad = ",".join(f"rgb({r},{g},{b})" for r, g, b in _STOPS)
        return _template().render(
            eid=self.element_id,
            css=_CSS.replace("#ID", f"#{self.element_id}").replace("GRAD", grad),
            title=self.title,
            kind=self.maps.kind,
            data=self._data(),
            stops=_STOPS,
        )
